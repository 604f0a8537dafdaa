use crate::b;

pub struct A(pub b::B);
