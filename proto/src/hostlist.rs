//! Slurm's host lists (`node[1-3,07],login`): how Slurm names several
//! nodes at once in its hooks' environment (`SLURM_NODELIST`) and in
//! `scontrol` output (`Nodes=node[1-2]`). One bracket per name, ranges and
//! single numbers inside it, the width of a range's first number kept
//! (`n[08-10]` is `n08`, `n09`, `n10`).

/// Most names [`expand_hostlist`] makes of one list; longer lists are not
/// read (no cluster has that many nodes, and a list may come from a job's
/// own text).
pub const MAX_NAMES: usize = 1 << 20;

/// The names of host list `s`, in order. `None` for what it cannot read.
pub fn expand_hostlist(s: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    for item in split_top(s.trim())? {
        match item.split_once('[') {
            None => out.push(item.to_string()),
            Some((prefix, rest)) => {
                let (ranges, suffix) = rest.split_once(']')?;
                if suffix.contains('[') || suffix.contains(']') {
                    return None;
                }
                for range in ranges.split(',') {
                    let (lo, hi, width) = bounds(range)?;
                    if hi - lo >= (MAX_NAMES - out.len()) as u64 {
                        return None;
                    }
                    for n in lo..=hi {
                        out.push(format!("{prefix}{n:0width$}{suffix}"));
                    }
                }
            }
        }
    }
    Some(out)
}

/// Whether host list `s` names `node`, without expanding it (a list of
/// any length costs no memory). `None` for what it cannot read.
pub fn hostlist_contains(s: &str, node: &str) -> Option<bool> {
    let mut found = false;
    for item in split_top(s.trim())? {
        match item.split_once('[') {
            None => found |= item == node,
            Some((prefix, rest)) => {
                let (ranges, suffix) = rest.split_once(']')?;
                if suffix.contains('[') || suffix.contains(']') {
                    return None;
                }
                let digits = node
                    .strip_prefix(prefix)
                    .and_then(|r| r.strip_suffix(suffix))
                    .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
                for range in ranges.split(',') {
                    let (lo, hi, width) = bounds(range)?;
                    if let Some(d) = digits {
                        // `n[08-10]` names `n09`, not `n9`; `n[8-10]` the other.
                        let fits = d.len() == width || (d.len() > width && !d.starts_with('0'));
                        found |= fits && d.parse::<u64>().is_ok_and(|n| (lo..=hi).contains(&n));
                    }
                }
            }
        }
    }
    Some(found)
}

/// `07-10` → (7, 10, width 2); `3` → (3, 3, width 1).
fn bounds(range: &str) -> Option<(u64, u64, usize)> {
    let (lo, hi) = range.split_once('-').unwrap_or((range, range));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(lo) || !digits(hi) {
        return None;
    }
    let (l, h): (u64, u64) = (lo.parse().ok()?, hi.parse().ok()?);
    (l <= h).then_some((l, h, lo.len()))
}

/// Splits at the commas outside brackets.
fn split_top(s: &str) -> Option<Vec<&str>> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0u32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return None;
    }
    parts.push(&s[start..]);
    Some(parts.into_iter().filter(|p| !p.is_empty()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lists() {
        assert_eq!(
            expand_hostlist("node[1-3],login").unwrap(),
            ["node1", "node2", "node3", "login"]
        );
        assert_eq!(
            expand_hostlist("n[08-10,14]x").unwrap(),
            ["n08x", "n09x", "n10x", "n14x"]
        );
        assert_eq!(expand_hostlist("node7").unwrap(), ["node7"]);
        assert_eq!(expand_hostlist("node[3-1]"), None);
        assert_eq!(expand_hostlist("node[1-2"), None);
        assert_eq!(expand_hostlist("a[1-2]b[1-2]"), None);
        assert_eq!(expand_hostlist("node[+1-2]"), None);
        assert_eq!(
            expand_hostlist("n[0-1048575]").map(|v| v.len()),
            Some(MAX_NAMES)
        );
        assert_eq!(expand_hostlist("n[0-1048576]"), None, "beyond MAX_NAMES");
        assert_eq!(expand_hostlist("n[0-600000],m[0-600000]"), None);
    }

    #[test]
    fn membership_without_expanding() {
        for (list, node, yes) in [
            ("node[1-3],login", "node2", true),
            ("node[1-3],login", "login", true),
            ("node[1-3],login", "node4", false),
            ("node[1-3],login", "node", false),
            ("n[08-10,14]x", "n09x", true),
            ("n[08-10,14]x", "n9x", false),
            ("n[8-10]", "n10", true),
            ("n[8-10]", "n08", false),
            ("n[0-18446744073709551615]", "n77", true),
            ("node1", "node1", true),
            ("node[1-2]", "node1x", false),
        ] {
            assert_eq!(hostlist_contains(list, node), Some(yes), "{list} {node}");
            if let Some(names) = expand_hostlist(list) {
                assert_eq!(names.iter().any(|n| n == node), yes, "{list} {node}");
            }
        }
        assert_eq!(hostlist_contains("node[1-2", "node1"), None);
        assert_eq!(hostlist_contains("node[2-1]", "node1"), None);
    }
}
