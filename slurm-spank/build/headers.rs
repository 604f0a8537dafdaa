//! Which Slurm headers the plugin is built from, and whether their release
//! is one the plugin is checked against. No I/O beyond reading the header
//! files: `build.rs` gives it the candidate directories and the
//! environment, and prints what it returns. `tests/version.rs` includes
//! this file too (`#[path]`), to test it and to read the header's version.

use std::fmt;
use std::path::{Path, PathBuf};

/// The oldest and newest Slurm releases (major, minor) whose `spank.h` the
/// plugin's use of it was checked against.
pub const CHECKED: ((u32, u32), (u32, u32)) = ((22, 5), (25, 11));

/// The environment variable naming the include directory (the one holding
/// `slurm/spank.h`).
pub const INCLUDE_DIR_VAR: &str = "SLURM_INCLUDE_DIR";

/// Set to 1 to build for a release outside [`CHECKED`].
pub const UNCHECKED_VAR: &str = "RFAAS_SLURM_UNCHECKED";

/// What the plugin uses of the headers; bindgen generates nothing else
/// (and the items these need). The built plugin leaves exactly
/// [`FUNCTIONS`] for Slurm to resolve.
pub const TYPES: &[&str] = &["spank_t", "spank_option", "spank_f", "spank_opt_cb_f"];
pub const FUNCTIONS: &[&str] = &[
    "spank_context",
    "spank_option_register",
    "spank_option_getopt",
    "spank_get_item",
    "spank_getenv",
    "spank_setenv",
    "spank_job_control_setenv",
    "slurm_info",
    "slurm_error",
];
pub const VARS: &[&str] = &[
    "SLURM_VERSION_NUMBER",
    "S_CTX_LOCAL",
    "S_CTX_REMOTE",
    "S_CTX_ALLOCATOR",
    "S_CTX_SLURMD",
    "S_JOB_UID",
    "S_JOB_ID",
    "S_TASK_ID",
    "S_SLURM_VERSION",
    "ESPANK_SUCCESS",
];

/// A Slurm release, as `SLURM_VERSION_NUMBER` encodes it (0xMMmmuu).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
}

impl Version {
    pub fn from_number(n: u32) -> Version {
        Version {
            major: (n >> 16) & 0xff,
            minor: (n >> 8) & 0xff,
            micro: n & 0xff,
        }
    }

    pub fn number(self) -> u32 {
        (self.major << 16) | (self.minor << 8) | self.micro
    }

    /// Whether the release is within [`CHECKED`] (the micro release does
    /// not matter: Slurm checks only major and minor).
    pub fn is_checked(self) -> bool {
        let release = (self.major, self.minor);
        CHECKED.0 <= release && release <= CHECKED.1
    }
}

/// As Slurm writes its releases: `22.05.8`.
impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:02}.{}", self.major, self.minor, self.micro)
    }
}

/// The `SLURM_VERSION_NUMBER` defined in the text of `slurm_version.h`.
pub fn parse_version(header: &str) -> Option<Version> {
    header.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        if words.next()? != "#define" || words.next()? != "SLURM_VERSION_NUMBER" {
            return None;
        }
        let value = words.next()?;
        let n = match value
            .strip_prefix("0x")
            .or_else(|| value.strip_prefix("0X"))
        {
            Some(hex) => u32::from_str_radix(hex, 16).ok()?,
            None => value.parse().ok()?,
        };
        Some(Version::from_number(n))
    })
}

/// The headers found: the include directory and the release they declare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headers {
    /// The directory holding `slurm/spank.h` (what `-I` takes).
    pub include_dir: PathBuf,
    pub version: Version,
}

impl Headers {
    /// `<include_dir>/slurm`, as the plugin reports it.
    pub fn slurm_dir(&self) -> PathBuf {
        self.include_dir.join("slurm")
    }
}

/// Where to look, and why there.
#[derive(Debug, Clone)]
pub struct Search {
    /// `SLURM_INCLUDE_DIR`, if set: then nothing else is tried.
    pub from_env: Option<PathBuf>,
    /// `pkg-config --variable=includedir slurm`, if that answered.
    pub from_pkg_config: Option<PathBuf>,
    /// `RFAAS_SLURM_UNCHECKED=1`.
    pub unchecked: bool,
}

/// The default include directory.
pub const DEFAULT_INCLUDE_DIR: &str = "/usr/include";

impl Search {
    /// The include directories to try, in order.
    pub fn candidates(&self) -> Vec<PathBuf> {
        if let Some(dir) = &self.from_env {
            return vec![dir.clone()];
        }
        let mut dirs: Vec<PathBuf> = self.from_pkg_config.iter().cloned().collect();
        let default = PathBuf::from(DEFAULT_INCLUDE_DIR);
        if !dirs.contains(&default) {
            dirs.push(default);
        }
        dirs
    }

    /// The first candidate holding both headers, with its release checked.
    pub fn find(&self) -> Result<Headers, String> {
        let candidates = self.candidates();
        let Some(include_dir) = candidates
            .iter()
            .find(|dir| dir.join("slurm/spank.h").is_file())
        else {
            return Err(self.missing(&candidates, "spank.h"));
        };
        let version_h = include_dir.join("slurm/slurm_version.h");
        let text = std::fs::read_to_string(&version_h)
            .map_err(|_| self.missing(std::slice::from_ref(include_dir), "slurm_version.h"))?;
        let version = parse_version(&text).ok_or_else(|| {
            format!(
                "rfaas_spank: {} defines no SLURM_VERSION_NUMBER; point {INCLUDE_DIR_VAR} at the \
                 include directory of a Slurm installation (the one holding slurm/spank.h)",
                version_h.display()
            )
        })?;
        if !version.is_checked() && !self.unchecked {
            return Err(out_of_range(&version_h, version));
        }
        Ok(Headers {
            include_dir: include_dir.clone(),
            version,
        })
    }

    /// The message for a header found in none of `dirs`.
    fn missing(&self, dirs: &[PathBuf], header: &str) -> String {
        let looked: Vec<String> = dirs
            .iter()
            .map(|d| d.join("slurm").display().to_string())
            .collect();
        let how = match (&self.from_env, &self.from_pkg_config) {
            (Some(_), _) => format!("{INCLUDE_DIR_VAR} set"),
            (None, Some(_)) => format!("{INCLUDE_DIR_VAR} unset; pkg-config's includedir tried"),
            (None, None) => format!("{INCLUDE_DIR_VAR} unset"),
        };
        format!(
            "rfaas_spank: <slurm/{header}> not found in {} ({how}): install libslurm-dev \
             (Debian/Ubuntu) or slurm-devel (RHEL family), or set {INCLUDE_DIR_VAR} to the \
             directory holding slurm/{header}",
            looked.join(" or ")
        )
    }
}

/// The message for a release outside [`CHECKED`].
pub fn out_of_range(version_h: &Path, version: Version) -> String {
    let ((a, b), (c, d)) = CHECKED;
    format!(
        "rfaas_spank: {} says Slurm {version}; rfaas_spank is checked against {a}.{b:02} .. \
         {c}.{d:02}; check that the declarations it uses are unchanged in that release's \
         spank.h, then build with {UNCHECKED_VAR}=1 to build it anyway",
        version_h.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(number: &str) -> String {
        format!(
            "#ifndef _SLURM_VERSION_H_\n#define _SLURM_VERSION_H_\n\n\
             #define SLURM_VERSION_NUMBER {number}\n\n\
             #define SLURM_VERSION_NUM(a,b,c) (((a) << 16) + ((b) << 8) + (c))\n#endif\n"
        )
    }

    /// A throwaway include directory with `slurm/spank.h` and a
    /// `slurm_version.h` defining `number` (none if `None`).
    fn include_dir(name: &str, number: Option<&str>) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("rfaas-spank-headers-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("slurm")).unwrap();
        std::fs::write(dir.join("slurm/spank.h"), "/* spank */\n").unwrap();
        if let Some(number) = number {
            std::fs::write(dir.join("slurm/slurm_version.h"), header(number)).unwrap();
        }
        dir
    }

    fn search(dir: &Path, unchecked: bool) -> Search {
        Search {
            from_env: Some(dir.to_path_buf()),
            from_pkg_config: None,
            unchecked,
        }
    }

    #[test]
    fn releases_parse_from_the_version_header() {
        let cases = [
            ("0x160508", "22.05.8", true),
            ("0x180b05", "24.11.5", true),
            ("0x190b00", "25.11.0", true),
            ("0x150808", "21.08.8", false),
            ("0x1a0500", "26.05.0", false),
            ("1443080", "22.05.8", true),
        ];
        for (number, shown, checked) in cases {
            let v = parse_version(&header(number)).unwrap();
            assert_eq!(v.to_string(), shown, "{number}");
            assert_eq!(v.is_checked(), checked, "{number}");
        }
        assert_eq!(
            parse_version(&header("0x160508")).unwrap().number(),
            0x160508
        );
        assert_eq!(parse_version("#define SLURM_VERSION_NUM(a,b,c) 0\n"), None);
        assert_eq!(parse_version(&header("0xzz")), None);
    }

    #[test]
    fn a_missing_header_names_where_it_looked_and_what_to_do() {
        let e = search(Path::new("/nonexistent"), false).find().unwrap_err();
        assert_eq!(
            e,
            "rfaas_spank: <slurm/spank.h> not found in /nonexistent/slurm (SLURM_INCLUDE_DIR \
             set): install libslurm-dev (Debian/Ubuntu) or slurm-devel (RHEL family), or set \
             SLURM_INCLUDE_DIR to the directory holding slurm/spank.h"
        );
        let without_env = Search {
            from_env: None,
            from_pkg_config: Some(PathBuf::from("/opt/slurm/include")),
            unchecked: false,
        };
        assert_eq!(
            without_env.candidates(),
            [
                PathBuf::from("/opt/slurm/include"),
                PathBuf::from("/usr/include")
            ]
        );
        let dir = include_dir("no-version", None);
        let e = search(&dir, false).find().unwrap_err();
        assert!(e.contains("<slurm/slurm_version.h> not found in"), "{e}");
        assert!(e.contains(&dir.join("slurm").display().to_string()), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_release_outside_the_checked_range_needs_the_unchecked_switch() {
        let dir = include_dir("new", Some("0x1a0500"));
        let e = search(&dir, false).find().unwrap_err();
        assert!(e.contains("says Slurm 26.05.0"), "{e}");
        assert!(e.contains("checked against 22.05 .. 25.11"), "{e}");
        assert!(e.contains("RFAAS_SLURM_UNCHECKED=1"), "{e}");
        let found = search(&dir, true).find().unwrap();
        assert_eq!(found.version.to_string(), "26.05.0");
        assert_eq!(found.slurm_dir(), dir.join("slurm"));
        std::fs::remove_dir_all(&dir).unwrap();

        let dir = include_dir("old", Some("0x150808"));
        let e = search(&dir, false).find().unwrap_err();
        assert!(e.contains("says Slurm 21.08.8"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();

        let dir = include_dir("bookworm", Some("0x160508"));
        let found = search(&dir, false).find().unwrap();
        assert_eq!(found.version.number(), 0x160508);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
