//! CPU cache prefetch hints, for lookups whose addresses are known ahead
//! of their use (a replay knows its next requests).
//!
//! A prefetch only hints the CPU to bring a cache line in; it cannot fault
//! nor change memory, so any address is allowed, and a wrong one only
//! costs a wasted load. On targets without the instruction it does nothing.

/// Hints that the cache line holding `*p` will be read soon (into every
/// cache level).
#[inline(always)]
pub fn prefetch_read<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint: it never faults and never writes, for
    // any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_of_any_address_is_harmless() {
        let v = [1u64, 2, 3];
        prefetch_read(&v[1]);
        prefetch_read(std::ptr::null::<u64>());
        prefetch_read(usize::MAX as *const u8);
        assert_eq!(v, [1, 2, 3]);
    }
}
