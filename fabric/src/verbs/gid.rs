//! GIDs for RoCE: which source GID a queue pair should use for an IP address.
//!
//! rdma_cm chooses the source GID itself (see the module doc of `verbs`);
//! this module only checks and reports that choice: it knows the form of the
//! GID of an IPv4 address (`::ffff:a.b.c.d`, the IPv4-mapped IPv6 address),
//! the GID types the kernel reports in sysfs, and how to pick the entry of a
//! GID table that belongs to an address.

use std::net::IpAddr;

use rdma_sys::{ibv_context, ibv_gid, ibv_query_gid};

/// The GID type of a table entry, from
/// `/sys/class/infiniband/<dev>/ports/<port>/gid_attrs/types/<index>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GidKind {
    /// InfiniBand, or RoCE v1 (`IB/RoCE v1`).
    RoceV1,
    /// RoCE v2 (`RoCE v2`): routable UDP encapsulation.
    RoceV2,
    /// The kernel did not say.
    Unknown,
}

impl GidKind {
    /// Parses the sysfs text.
    pub(crate) fn parse(text: &str) -> GidKind {
        match text.trim() {
            "RoCE v2" => GidKind::RoceV2,
            "IB/RoCE v1" | "RoCE v1" | "IB" => GidKind::RoceV1,
            _ => GidKind::Unknown,
        }
    }
}

/// One entry of a port's GID table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GidEntry {
    pub(crate) index: u8,
    pub(crate) gid: [u8; 16],
    pub(crate) kind: GidKind,
}

/// The GID RoCE uses for `ip`: the IPv4-mapped form for IPv4, the address
/// itself for IPv6.
pub(crate) fn gid_of_ip(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The index of the GID of `ip` in `table`, preferring RoCE v2 (what
/// rdma_cm uses by default) over v1 and unknown types.
pub(crate) fn select_gid(table: &[GidEntry], ip: IpAddr) -> Option<u8> {
    let want = gid_of_ip(ip);
    let rank = |kind| match kind {
        GidKind::RoceV2 => 0,
        GidKind::Unknown => 1,
        GidKind::RoceV1 => 2,
    };
    table
        .iter()
        .filter(|e| e.gid == want)
        .min_by_key(|e| (rank(e.kind), e.index))
        .map(|e| e.index)
}

/// Formats a GID like an IPv6 address (how `rdma`/`ibv_devinfo -v` show them).
pub(crate) fn format_gid(gid: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*gid).to_string()
}

/// Reads entry `index` of `port`'s GID table, with its type from sysfs.
///
/// # Safety
///
/// `ctx` is an open device context.
pub(crate) unsafe fn query_gid(
    ctx: *mut ibv_context,
    device: &str,
    port: u8,
    index: u8,
) -> Option<GidEntry> {
    // SAFETY: ibv_gid is a plain union of bytes.
    let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is open (caller's contract); gid is a valid out-pointer.
    let rc = unsafe { ibv_query_gid(ctx, port, i32::from(index), &mut gid) };
    if rc != 0 {
        return None;
    }
    let path = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}");
    let kind = std::fs::read_to_string(path).map_or(GidKind::Unknown, |t| GidKind::parse(&t));
    Some(GidEntry {
        index,
        // SAFETY: every bit pattern is a valid [u8; 16].
        gid: unsafe { gid.raw },
        kind,
    })
}

/// Reads the first `len` entries of `port`'s GID table (skipping empty ones).
///
/// # Safety
///
/// `ctx` is an open device context.
pub(crate) unsafe fn gid_table(
    ctx: *mut ibv_context,
    device: &str,
    port: u8,
    len: usize,
) -> Vec<GidEntry> {
    (0..len.min(256))
        // SAFETY: ctx is open (caller's contract).
        .filter_map(|i| unsafe { query_gid(ctx, device, port, i as u8) })
        .filter(|e| e.gid != [0; 16])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn entry(index: u8, gid: &str, kind: GidKind) -> GidEntry {
        let ip: std::net::Ipv6Addr = gid.parse().unwrap();
        GidEntry {
            index,
            gid: ip.octets(),
            kind,
        }
    }

    /// The table rxe shows on eth0 with 192.0.2.1 (Soft-RoCE is v2 only).
    fn rxe_table() -> Vec<GidEntry> {
        vec![
            entry(0, "fe80::5054:ff:fe12:3401", GidKind::RoceV2),
            entry(1, "::ffff:192.0.2.1", GidKind::RoceV2),
        ]
    }

    /// A NIC that lists every address once per RoCE version.
    fn dual_table() -> Vec<GidEntry> {
        vec![
            entry(0, "fe80::1", GidKind::RoceV1),
            entry(1, "fe80::1", GidKind::RoceV2),
            entry(2, "::ffff:10.1.2.3", GidKind::RoceV1),
            entry(3, "::ffff:10.1.2.3", GidKind::RoceV2),
        ]
    }

    #[rstest]
    #[case::rxe_ipv4(rxe_table(), "192.0.2.1", Some(1))]
    #[case::rxe_link_local(rxe_table(), "fe80::5054:ff:fe12:3401", Some(0))]
    #[case::rxe_foreign(rxe_table(), "192.0.2.2", None)]
    #[case::dual_prefers_v2(dual_table(), "10.1.2.3", Some(3))]
    #[case::dual_ipv6_prefers_v2(dual_table(), "fe80::1", Some(1))]
    fn selects_the_gid_of_the_address(
        #[case] table: Vec<GidEntry>,
        #[case] ip: &str,
        #[case] want: Option<u8>,
    ) {
        assert_eq!(select_gid(&table, ip.parse().unwrap()), want);
    }

    #[test]
    fn v1_only_tables_still_match() {
        let table = vec![entry(5, "::ffff:10.0.0.7", GidKind::RoceV1)];
        assert_eq!(select_gid(&table, "10.0.0.7".parse().unwrap()), Some(5));
    }

    #[test]
    fn ipv4_gids_are_ipv4_mapped() {
        let gid = gid_of_ip("192.0.2.1".parse().unwrap());
        assert_eq!(
            gid,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1]
        );
        assert_eq!(format_gid(&gid), "::ffff:192.0.2.1");
    }

    #[rstest]
    #[case("RoCE v2\n", GidKind::RoceV2)]
    #[case("IB/RoCE v1\n", GidKind::RoceV1)]
    #[case("", GidKind::Unknown)]
    fn parses_sysfs_gid_types(#[case] text: &str, #[case] kind: GidKind) {
        assert_eq!(GidKind::parse(text), kind);
    }
}
