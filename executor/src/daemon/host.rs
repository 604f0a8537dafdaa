//! What the daemon finds out about its host for the keys a configuration
//! leaves out, so one file serves every node: the node's name (`slurmd
//! -C`'s `NodeName`, else the short host name), the fabric address (the
//! local address of the route to the first manager), and the CPUs and
//! memory it lends (what `slurmd -C` says the node has, else the online
//! CPUs and `MemTotal`, less a reserve for the system).

use std::fmt;
use std::net::{IpAddr, ToSocketAddrs, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// Where a setting's value came from, as `--check-config` prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The configuration file.
    File,
    /// A command-line flag.
    Flag,
    /// The daemon's default.
    Default,
    /// `slurmd -C`.
    Slurmd,
    /// The host name.
    Hostname,
    /// The route to the first manager.
    Route,
    /// The kernel (`/sys/devices/system/cpu/online`, `/proc/meminfo`).
    Machine,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::File => "file",
            Source::Flag => "flag",
            Source::Default => "default",
            Source::Slurmd => "discovered: slurmd -C",
            Source::Hostname => "discovered: hostname",
            Source::Route => "discovered: route",
            Source::Machine => "discovered: kernel",
        })
    }
}

/// The node as `slurmd -C` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmdNode {
    /// `NodeName`.
    pub name: String,
    /// `CPUs`.
    pub cpus: u32,
    /// `RealMemory`, MiB.
    pub real_memory_mib: u64,
}

/// Reads `slurmd -C`'s output (`NodeName=cn01 CPUs=64 ... RealMemory=257543`
/// on its first line; later releases may add fields such as `Gres=` and
/// lines such as `UpTime=`).
pub fn parse_slurmd_c(text: &str) -> Result<SlurmdNode, String> {
    let field = |key: &str| {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
            .ok_or_else(|| format!("slurmd -C printed no {key}= in {:?}", text.trim()))
    };
    let number = |key: &str| {
        let v = field(key)?;
        v.parse::<u64>()
            .map_err(|_| format!("slurmd -C printed {key}={v}, not a number"))
    };
    Ok(SlurmdNode {
        name: field("NodeName")?.to_owned(),
        cpus: u32::try_from(number("CPUs")?).map_err(|_| "slurmd -C printed too many CPUs")?,
        real_memory_mib: number("RealMemory")?,
    })
}

/// The CPUs lent: `online` (ascending), cut to the `slurm_cpus` Slurm
/// counts when it counts fewer, less the `reserve` highest-numbered ones.
/// The highest go, so Slurm's CPU id i stays the i-th lent CPU (the
/// `[slurm] cpu_map = "index"` default).
pub fn lent_cpus(
    online: &[u32],
    slurm_cpus: Option<u32>,
    reserve: u32,
) -> Result<Vec<u32>, String> {
    let have = slurm_cpus.map_or(online.len(), |n| online.len().min(n as usize));
    let keep = have.saturating_sub(reserve as usize);
    if keep == 0 {
        return Err(format!(
            "the node has {have} CPUs and reserve_cpus keeps {reserve} for the system, \
             which leaves none to lend; lower reserve_cpus or set cpus"
        ));
    }
    Ok(online[..keep].to_vec())
}

/// The memory lent, MiB: `total` less `reserve`.
pub fn lent_memory_mib(total: u64, reserve: u32) -> Result<u32, String> {
    match total.checked_sub(u64::from(reserve)) {
        Some(m) if m > 0 => Ok(u32::try_from(m).unwrap_or(u32::MAX)),
        _ => Err(format!(
            "the node has {total} MiB and reserve_memory_mib keeps {reserve} MiB for the \
             system, which leaves none to lend; lower reserve_memory_mib or set memory_mib"
        )),
    }
}

/// What the host says about itself. [`System`] asks the machine; tests
/// give fixed answers.
pub trait Probe {
    /// `slurmd -C`'s account; `None` when slurmd is not installed.
    fn slurmd(&self) -> Option<Result<SlurmdNode, String>>;
    /// The host name (`gethostname`).
    fn hostname(&self) -> std::io::Result<String>;
    /// The local address of the route to `host:port`.
    fn route_to(&self, host: &str, port: u16) -> std::io::Result<IpAddr>;
    /// The online CPUs, ascending.
    fn online_cpus(&self) -> Vec<u32>;
    /// `MemTotal`, MiB.
    fn memory_mib(&self) -> u64;
}

/// The machine this runs on; `slurmd -C` runs at most once.
#[derive(Debug, Default)]
pub struct System {
    slurmd: OnceLock<Option<Result<SlurmdNode, String>>>,
}

/// Where slurmd is looked for besides `PATH` (a daemon's `PATH` may lack
/// the sbin directories).
const SLURMD_PATHS: [&str; 2] = ["/usr/sbin/slurmd", "/usr/local/sbin/slurmd"];

/// `slurmd -C` answers from the hardware in milliseconds; this bounds a
/// hung one.
const SLURMD_TIMEOUT: Duration = Duration::from_secs(10);

impl System {
    fn run_slurmd() -> Option<Result<SlurmdNode, String>> {
        let on_path = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("slurmd"))
                .find(|p| p.is_file())
        });
        let program = on_path.or_else(|| {
            SLURMD_PATHS
                .iter()
                .map(Path::new)
                .find(|p| p.is_file())
                .map(Path::to_path_buf)
        })?;
        let mut cmd = Command::new(&program);
        cmd.arg("-C");
        let run = super::slurm::scontrol::run_bounded(cmd, &program, SLURMD_TIMEOUT);
        Some(match run {
            Ok((status, out, _)) if status.success() => parse_slurmd_c(&out),
            Ok((status, _, err)) => Err(format!(
                "{} -C failed ({status}): {}",
                program.display(),
                err.trim()
            )),
            Err(e) => Err(e.to_string()),
        })
    }
}

impl Probe for System {
    fn slurmd(&self) -> Option<Result<SlurmdNode, String>> {
        self.slurmd.get_or_init(System::run_slurmd).clone()
    }

    fn hostname(&self) -> std::io::Result<String> {
        let mut buf = [0u8; 256];
        // SAFETY: buf is writable for its whole length.
        if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..len]).into_owned())
    }

    fn route_to(&self, host: &str, port: u16) -> std::io::Result<IpAddr> {
        let target = (host, port).to_socket_addrs()?.next().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no address")
        })?;
        let any: IpAddr = if target.is_ipv4() {
            [0, 0, 0, 0].into()
        } else {
            [0u16; 8].into()
        };
        // connect() on a UDP socket only picks the route: no packet leaves.
        let socket = UdpSocket::bind((any, 0))?;
        socket.connect(target)?;
        Ok(socket.local_addr()?.ip())
    }

    fn online_cpus(&self) -> Vec<u32> {
        std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|s| parse_cpulist(s.trim()).ok())
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| {
                let n = std::thread::available_parallelism().map_or(1, |n| n.get());
                (0..n as u32).collect()
            })
    }

    fn memory_mib(&self) -> u64 {
        let kib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .unwrap_or(1 << 20);
        kib / 1024
    }
}

/// The short host name: up to the first dot, as Slurm names nodes.
pub fn short_name(hostname: &str) -> &str {
    hostname.split('.').next().unwrap_or(hostname)
}

/// Parses a Linux cpulist (`"0-3,8,10-11"`) into ascending, distinct CPUs.
pub fn parse_cpulist(list: &str) -> Result<Vec<u32>, String> {
    let mut cpus = std::collections::BTreeSet::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |s: &str| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| format!("{s:?} is not a CPU number; write a list like \"0-3,8\""))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("the range {part:?} runs backwards"));
                }
                if b - a >= 65_536 {
                    return Err(format!("the range {part:?} is too long"));
                }
                cpus.extend(a..=b);
            }
            None => {
                cpus.insert(num(part)?);
            }
        }
    }
    Ok(cpus.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurmd_c_of_22_05_and_24_11() {
        let old = "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 \
                   ThreadsPerCore=1 RealMemory=24105\nUpTime=0-11:54:02\n";
        assert_eq!(
            parse_slurmd_c(old).unwrap(),
            SlurmdNode {
                name: "vm".into(),
                cpus: 2,
                real_memory_mib: 24105
            }
        );
        let new = "NodeName=cn01 CPUs=64 Boards=1 SocketsPerBoard=2 CoresPerSocket=16 \
                   ThreadsPerCore=2 RealMemory=257543 Gres=gpu:a100:4\nUpTime=12-03:44:10\n";
        assert_eq!(
            parse_slurmd_c(new).unwrap(),
            SlurmdNode {
                name: "cn01".into(),
                cpus: 64,
                real_memory_mib: 257543
            }
        );
        let e = parse_slurmd_c("slurmd: fatal: no hardware\n").unwrap_err();
        assert!(e.contains("NodeName="), "{e}");
        let e = parse_slurmd_c("NodeName=a CPUs=x RealMemory=1").unwrap_err();
        assert!(e.contains("CPUs=x, not a number"), "{e}");
    }

    #[test]
    fn reserves_leave_the_highest_cpus_and_some_memory() {
        let online = [0, 1, 2, 3, 4, 5, 6, 7];
        assert_eq!(lent_cpus(&online, None, 0).unwrap(), online);
        assert_eq!(lent_cpus(&online, None, 2).unwrap(), [0, 1, 2, 3, 4, 5]);
        assert_eq!(lent_cpus(&online, Some(4), 1).unwrap(), [0, 1, 2]);
        assert_eq!(lent_cpus(&online, Some(16), 0).unwrap(), online);
        let e = lent_cpus(&online, Some(2), 2).unwrap_err();
        assert!(
            e.contains("has 2 CPUs") && e.contains("reserve_cpus"),
            "{e}"
        );
        assert_eq!(lent_memory_mib(24105, 1024).unwrap(), 23081);
        assert_eq!(lent_memory_mib(24105, 0).unwrap(), 24105);
        let e = lent_memory_mib(1024, 1024).unwrap_err();
        assert!(e.contains("1024 MiB") && e.contains("memory_mib"), "{e}");
    }

    #[test]
    fn short_names_and_the_route_to_loopback() {
        assert_eq!(short_name("cn01.cluster.example"), "cn01");
        assert_eq!(short_name("cn01"), "cn01");
        let ip = System::default().route_to("127.0.0.1", 7300).unwrap();
        assert_eq!(ip, IpAddr::from([127, 0, 0, 1]));
    }
}
