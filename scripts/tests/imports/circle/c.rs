pub fn f() -> u32 {
    let _ = std::mem::size_of::<crate::A>();
    1
}
