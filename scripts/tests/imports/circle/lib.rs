//! A circle a -> b -> c -> a, where c names a's type through the root's
//! re-export, and a circle between a mod.rs and its child.
mod a;
mod b;
mod c;
mod d;
mod e;

pub use a::A;

pub fn root() -> d::D {
    d::D
}
