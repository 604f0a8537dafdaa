//! What a row is, what it is given, and which rows run.
//!
//! A module that measures something exports one [`Suite`]: its rows and the
//! peer entry points those rows start with [`Ctx::spawn_peer`]. Each
//! binary's `main.rs` lists its suites; nothing else needs to know a row
//! exists.

use std::fmt;
use std::os::fd::BorrowedFd;

use crate::child::{Peer, PeerSpec};
use crate::error::{Error, Result};
use crate::report::Report;

/// Rows and peers of one measuring module.
#[derive(Debug, Clone, Copy)]
pub struct Suite {
    pub rows: &'static [RowSpec],
    pub peers: &'static [PeerSpec],
}

/// One named row (a name may produce one result per size and per provider).
#[derive(Debug, Clone, Copy)]
pub struct RowSpec {
    /// As given to `--rows` and printed in the `name` column.
    pub name: &'static str,
    /// What the row measures, in a user's words: one line of `--help`.
    pub help: &'static str,
    pub runner: Runner,
}

#[derive(Clone, Copy)]
pub enum Runner {
    /// Runs once whatever `--provider` says; its rows name their own provider
    /// (`mem` for in-process baselines).
    Once(fn(&Ctx, &mut Report) -> Result<()>),
    /// Runs once for each selected provider of `kind`, or of every kind when
    /// `kind` is `None`.
    PerProvider {
        kind: Option<Kind>,
        run: fn(&Ctx, &Provider, &mut Report) -> Result<()>,
    },
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Runner::Once(_) => f.write_str("Once"),
            Runner::PerProvider { kind, .. } => write!(f, "PerProvider({kind:?})"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Tcp,
    Shm,
    Verbs,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::Shm => "shm",
            Kind::Verbs => "verbs",
        }
    }
}

/// One `--provider` value: `tcp`, `shm` or `verbs:DEVICE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provider {
    /// As the user wrote it; rows print this in the `provider` column.
    pub spec: String,
    pub kind: Kind,
    /// The part after `:`, e.g. `rxe0`.
    pub device: Option<String>,
}

impl Provider {
    pub fn parse(spec: &str) -> Result<Provider> {
        let spec = spec.trim();
        let parsed: rfaas_fabric::ProviderKind = spec
            .parse()
            .map_err(|e: rfaas_fabric::Error| Error::new(e.to_string()))?;
        let (kind, device) = match parsed {
            rfaas_fabric::ProviderKind::Tcp => (Kind::Tcp, None),
            rfaas_fabric::ProviderKind::Shm => (Kind::Shm, None),
            rfaas_fabric::ProviderKind::Verbs(device) => (Kind::Verbs, Some(device)),
        };
        Ok(Provider {
            spec: spec.to_owned(),
            kind,
            device,
        })
    }
}

impl Provider {
    /// The address peers of this provider listen on: loopback for tcp
    /// (and shm, which ignores it), and for verbs the IPv4 address of the
    /// RDMA device's network interface, which rdma_cm routes through the
    /// device (a loopback address would not reach it).
    pub fn host(&self) -> Result<String> {
        match (&self.kind, &self.device) {
            (Kind::Verbs, Some(dev)) => device_ipv4(dev),
            _ => Ok("127.0.0.1".into()),
        }
    }
}

/// The first IPv4 address of the network interface behind RDMA device
/// `dev` (RoCE: port 1's GID table names it).
fn device_ipv4(dev: &str) -> Result<String> {
    let ndev_path = format!("/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/0");
    let ifname = std::fs::read_to_string(&ndev_path)
        .map(|s| s.trim().to_owned())
        .map_err(|e| {
            Error::new(format!(
                "cannot find the network interface of RDMA device {dev} ({ndev_path}: {e}); \
                 is it a RoCE device? (ibv_devices lists the devices)"
            ))
        })?;
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `addrs` with a list freed below.
    if unsafe { libc::getifaddrs(&mut addrs) } != 0 {
        return Err(Error::new(format!(
            "cannot list the network interfaces: {}",
            std::io::Error::last_os_error()
        )));
    }
    let mut found = None;
    let mut cur = addrs;
    while !cur.is_null() && found.is_none() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, which
        // stays valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string of the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: ifa_addr points to a sockaddr of the list.
        let family = unsafe { (*ifa.ifa_addr).sa_family };
        if name.to_bytes() == ifname.as_bytes() && i32::from(family) == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            found = Some(std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
        }
    }
    // SAFETY: `addrs` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(addrs) };
    found.map(|a| a.to_string()).ok_or_else(|| {
        Error::new(format!(
            "RDMA device {dev}'s interface {ifname} has no IPv4 address; give it one \
             (rdma_cm resolves routes by IP)"
        ))
    })
}

/// Everything a row is given: the parsed command line and the CPU layout.
#[derive(Debug, Clone)]
pub struct Ctx {
    pub providers: Vec<Provider>,
    /// Latency message sizes in bytes.
    pub sizes: Vec<usize>,
    /// Bandwidth message sizes in bytes.
    pub bw_sizes: Vec<usize>,
    /// Timed latency iterations.
    pub iters: usize,
    /// Untimed iterations before them.
    pub warmup: usize,
    /// Bytes moved per bandwidth measurement (at least 8 messages).
    pub bw_bytes: u64,
    /// The CPU the bench itself is pinned to, if pinning.
    pub cpu: Option<usize>,
    /// The CPU peers are pinned to, if pinning.
    pub peer_cpu: Option<usize>,
    /// What the invocation rows need (`rfaas-bench` only).
    pub invoke: crate::invoke::Settings,
}

impl Ctx {
    /// Operations completed per rate measurement: ten latency rows' worth.
    pub fn rate_calls(&self) -> u64 {
        (self.iters as u64 * 10).max(1000)
    }

    /// How many `size`-byte messages make up one bandwidth measurement.
    pub fn bw_messages(&self, size: usize) -> u64 {
        self.bw_bytes.div_ceil(size.max(1) as u64).max(8)
    }

    /// Starts `--serve <what> <args>...` on the peer CPU; see [`Peer::spawn`].
    pub fn spawn_peer(
        &self,
        what: &str,
        args: &[String],
        inherit: &[BorrowedFd<'_>],
    ) -> Result<Peer> {
        Peer::spawn(what, args, self.peer_cpu, inherit)
    }
}

/// Runs every row in `suites` that `filter` selects, in order.
pub fn run(suites: &[Suite], filter: Option<&[String]>, ctx: &Ctx, out: &mut Report) -> Result<()> {
    let selected = |name: &str| filter.map_or(true, |f| f.iter().any(|r| r == name));
    for row in suites.iter().flat_map(|s| s.rows) {
        if !selected(row.name) {
            continue;
        }
        match row.runner {
            Runner::Once(run) => run(ctx, out)?,
            Runner::PerProvider { kind, run } => {
                let mut ran = false;
                for provider in &ctx.providers {
                    if kind.map_or(true, |k| k == provider.kind) {
                        run(ctx, provider, out)?;
                        ran = true;
                    }
                }
                if !ran && filter.is_some() {
                    let kind = kind.map_or("any", Kind::as_str);
                    eprintln!(
                        "note: row {} did not run: no --provider of kind {kind} is selected",
                        row.name
                    );
                }
            }
        }
    }
    Ok(())
}

/// Fails on any `--rows` name no suite defines.
pub fn check_filter(suites: &[Suite], filter: &[String]) -> Result<()> {
    let known: Vec<&str> = suites.iter().flat_map(|s| s.rows).map(|r| r.name).collect();
    match filter.iter().find(|f| !known.contains(&f.as_str())) {
        Some(unknown) => Err(Error::new(format!(
            "unknown row `{unknown}` in --rows; the rows are {}",
            known.join(", ")
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn providers_parse() {
        assert_eq!(Provider::parse("tcp").unwrap().kind, Kind::Tcp);
        assert_eq!(Provider::parse(" shm ").unwrap().spec, "shm");
        let v = Provider::parse("verbs:rxe0").unwrap();
        assert_eq!((v.kind, v.device.as_deref()), (Kind::Verbs, Some("rxe0")));
        assert!(Provider::parse("verbs").is_err());
        assert!(Provider::parse("verbs:").is_err());
        assert!(Provider::parse("udp").is_err());
        assert!(Provider::parse("tcp:eth0").is_err());
    }

    #[test]
    fn at_least_eight_bandwidth_messages() {
        let ctx = Ctx {
            providers: vec![],
            sizes: vec![],
            bw_sizes: vec![],
            iters: 0,
            warmup: 0,
            bw_bytes: 1 << 20,
            cpu: None,
            peer_cpu: None,
            invoke: Default::default(),
        };
        assert_eq!(ctx.bw_messages(1 << 20), 8);
        assert_eq!(ctx.bw_messages(1024), 1024);
        assert_eq!(ctx.bw_messages(1000), 1049);
    }
}
