pub struct B;

impl B {
    pub fn go() -> u32 {
        crate::c::f()
    }
}
