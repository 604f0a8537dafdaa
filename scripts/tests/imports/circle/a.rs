use super::b::B;

pub struct A(pub B);
