// A test module names the root, which names d: no circle, as nothing
// names the tests.
pub struct D;

#[cfg(test)]
mod tests {
    use crate::*;

    #[test]
    fn root_is_d() {
        let _: super::D = root();
    }
}
