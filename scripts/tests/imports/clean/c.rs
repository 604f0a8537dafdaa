use crate::A;

pub struct C(pub A);

#[cfg(test)]
mod tests {
    use super::super::c::C;

    #[test]
    fn holds_a() {
        let _ = C(crate::A(crate::b::B));
    }
}
