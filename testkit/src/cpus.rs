//! The CPUs a test may use, and pinning a test's thread to one.

/// The CPUs the calling thread may run on, in order.
pub fn allowed() -> Vec<u32> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid set of its own size; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    assert_eq!(rc, 0, "sched_getaffinity");
    (0..libc::CPU_SETSIZE as u32)
        // SAFETY: i is below CPU_SETSIZE.
        .filter(|&i| unsafe { libc::CPU_ISSET(i as usize, &set) })
        .collect()
}

/// Pins the calling thread to `cpu`, one of [`allowed`].
pub fn pin_this_thread(cpu: u32) {
    // SAFETY: cpu_set_t is plain data.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: cpu is below CPU_SETSIZE (it came from `allowed`).
    unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    // SAFETY: a valid set of its own size; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    assert_eq!(rc, 0, "sched_setaffinity to CPU {cpu}");
}
