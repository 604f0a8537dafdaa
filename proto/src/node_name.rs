//! Node names: the one pattern every node's name follows, wherever it is
//! written (executord's `node_name`, the manager's API, lease tokens).
//!
//! A node's name ends up in file paths, log lines, URL paths and
//! Prometheus label values, so it is plain: 1 to [`MAX_LEN`] ASCII
//! letters, digits, `-`, `_` and `.`, starting with a letter or a digit,
//! with dots only between non-empty parts. Slurm's node names (`node01`,
//! `gpu-3`, `cn_12`) and host names (`node1.cluster`) pass; `.`, `..`,
//! `/`, spaces, control characters and anything not ASCII do not, nor a
//! leading `-` (it reads as a flag on a command line), nor a dot at either
//! end or next to another.

use std::fmt;

/// The longest node name, bytes (the longest DNS name).
pub const MAX_LEN: usize = 253;

/// The pattern as a regular expression (for the OpenAPI document); the
/// length is bounded by [`MAX_LEN`] as well.
pub const PATTERN: &str = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$";

/// The pattern in words, for error messages.
pub const RULE: &str = "1 to 253 ASCII letters, digits, '-', '_' and '.', starting with a letter or digit, with each '.' between two non-empty parts";

/// A name that is not a node name: which one and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeNameError {
    /// The name refused.
    pub name: String,
    /// What is wrong with it.
    pub why: String,
}

impl fmt::Display for NodeNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a node name: {}; a node name is {RULE} (the pattern {PATTERN})",
            self.name, self.why
        )
    }
}

impl std::error::Error for NodeNameError {}

fn part_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'_'
}

/// Checks `name` against the pattern, byte by byte.
pub fn check(name: &str) -> Result<(), NodeNameError> {
    let refuse = |why: String| {
        Err(NodeNameError {
            name: name.to_owned(),
            why,
        })
    };
    let bytes = name.as_bytes();
    let Some(&first) = bytes.first() else {
        return refuse("it is empty".into());
    };
    if bytes.len() > MAX_LEN {
        return refuse(format!("it is {} bytes long", bytes.len()));
    }
    if !first.is_ascii_alphanumeric() {
        return refuse(format!("it starts with {:?}", char::from(first)));
    }
    for (at, pair) in bytes.windows(2).enumerate() {
        if pair == b".." {
            return refuse(format!("it has two dots in a row at byte {at}"));
        }
    }
    if bytes.last() == Some(&b'.') {
        return refuse("it ends with a dot".into());
    }
    if let Some(at) = bytes.iter().position(|&b| !part_byte(b) && b != b'.') {
        return refuse(format!(
            "byte {at} is {}",
            match bytes[at] {
                b if b.is_ascii_graphic() || b == b' ' => format!("{:?}", char::from(b)),
                b => format!("0x{b:02x}"),
            }
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_and_host_names_pass() {
        for name in [
            "n",
            "7",
            "node01",
            "gpu-3",
            "cn_12",
            "Node-A_1",
            "node1.cluster",
            "node1.cluster.example.org",
            "a.b-c_d.e",
            "rack3-node.x_",
            "0.1",
        ] {
            assert_eq!(check(name), Ok(()), "{name}");
        }
        assert_eq!(check(&"a".repeat(MAX_LEN)), Ok(()));
    }

    #[test]
    fn dots_slashes_and_empty_parts_are_refused() {
        for name in [
            "", ".", "..", "...", ".a", "a.", "a..b", "/", "a/b", "../etc", "./a", "-n", "_n",
            "a b", "a:b", "a@b", "a%2e", "a\\b",
        ] {
            let err = check(name).unwrap_err();
            assert_eq!(err.name, name);
            let text = err.to_string();
            assert!(text.contains(PATTERN) && text.contains(RULE), "{text}");
        }
        assert!(check(&"a".repeat(MAX_LEN + 1))
            .unwrap_err()
            .why
            .contains("254 bytes"));
        assert_eq!(
            check("a..b").unwrap_err().why,
            "it has two dots in a row at byte 1"
        );
        assert_eq!(check("").unwrap_err().why, "it is empty");
    }

    /// Every byte, alone, first, inside and last: only letters, digits,
    /// `-`, `_` (not first) and `.` (inside only) pass.
    #[test]
    fn every_byte() {
        for b in 0u8..=255 {
            let inside = b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.';
            let first = b.is_ascii_alphanumeric();
            let last = inside && b != b'.';
            // Bytes above 0x7f are not text alone: their UTF-8 form.
            let s = char::from(b).to_string();
            assert_eq!(check(&s).is_ok(), first, "{b:#04x} alone");
            assert_eq!(check(&format!("{s}a")).is_ok(), first, "{b:#04x} first");
            assert_eq!(check(&format!("a{s}a")).is_ok(), inside, "{b:#04x} inside");
            assert_eq!(check(&format!("a{s}")).is_ok(), last, "{b:#04x} last");
        }
    }

    #[test]
    fn control_and_non_ascii_bytes_are_named_by_value() {
        assert_eq!(check("a\u{0}b").unwrap_err().why, "byte 1 is 0x00");
        assert_eq!(check("a\nb").unwrap_err().why, "byte 1 is 0x0a");
        assert_eq!(check("nœud").unwrap_err().why, "byte 1 is 0xc5");
        assert_eq!(check("a b").unwrap_err().why, "byte 1 is ' '");
        assert_eq!(check("a/b").unwrap_err().why, "byte 1 is '/'");
    }
}
