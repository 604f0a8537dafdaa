// crate::c::C would be a circle, were comments read.
pub struct B;

pub const NAME: &str = "crate::c::C";
