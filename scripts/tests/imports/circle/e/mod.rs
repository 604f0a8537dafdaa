mod child;

pub struct Shared;

pub fn run() {
    child::work(&Shared);
}
