use super::Shared;

pub fn work(_: &Shared) {}
