//! Process limits a daemon adjusts at start.

/// The descriptor limit (`RLIMIT_NOFILE`) after [`raise_descriptor_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorLimit {
    /// The soft limit now in force.
    pub soft: u64,
    /// The hard limit, which only a privileged process can raise.
    pub hard: u64,
}

/// Raises this process's soft descriptor limit to its hard one. Every
/// connection takes a descriptor, and service managers' usual soft limit
/// (1024) would let a few hundred idle sockets make a server unreachable
/// (its accepts fail with `EMFILE`). `None`: the limit cannot be read.
pub fn raise_descriptor_limit() -> Option<DescriptorLimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write only `lim`, ours.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    Some(DescriptorLimit {
        soft: lim.rlim_cur,
        hard: lim.rlim_max,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in raise_descriptor_limit.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
            lim.rlim_cur = lim.rlim_max.min(256);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
        let got = raise_descriptor_limit().expect("the limit is readable");
        assert_eq!(got.soft, got.hard);
        assert_eq!(got.hard, lim.rlim_max);
    }
}
