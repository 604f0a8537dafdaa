//! Dependencies only one way: lib -> a -> b, c -> a (through the root's
//! re-export, followed to a.rs), nothing back. Comments and strings that
//! name crate::c are not read.
mod a;
mod b;
mod c;

pub use a::A;
