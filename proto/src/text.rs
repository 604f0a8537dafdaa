//! Words of the sentences rfaas shows people: counts in the right form, so
//! that no message says "1 cores". Shared by every crate's errors.

/// `n` and its noun, singular or plural: "1 core", "2 cores", "0 bytes".
/// Nouns take an `s`: use it for the regular ones rfaas counts (byte, core,
/// lane, function, invocation, element, allocation, worker).
pub fn count(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_is_singular_everything_else_plural() {
        assert_eq!(count(1u32, "core"), "1 core");
        assert_eq!(count(0u32, "core"), "0 cores");
        assert_eq!(count(2u16, "core"), "2 cores");
        assert_eq!(count(u64::MAX, "byte"), format!("{} bytes", u64::MAX));
    }
}
