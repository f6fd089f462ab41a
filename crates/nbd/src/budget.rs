//! A byte budget bounding the payload memory of in-flight requests.
//!
//! Shared by every connection of a server. A request takes its share before
//! its buffer is allocated and gives it back when its reply has been sent
//! (by dropping the [`BudgetGuard`]).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Counting budget of bytes, blocking when exhausted.
#[derive(Debug)]
pub(crate) struct Budget {
    capacity: usize,
    /// (bytes taken, threads waiting for room)
    used: Mutex<(usize, usize)>,
    freed: Condvar,
}

impl Budget {
    /// A budget of `capacity` bytes.
    pub(crate) fn new(capacity: usize) -> Arc<Budget> {
        Arc::new(Budget {
            capacity,
            used: Mutex::new((0, 0)),
            freed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, (usize, usize)> {
        self.used.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `bytes` from the budget, waiting until they are available. A
    /// request larger than the whole budget waits until nothing else is in
    /// flight and then proceeds alone.
    pub(crate) fn acquire(self: &Arc<Self>, bytes: usize) -> BudgetGuard {
        if bytes > 0 {
            let mut used = self.lock();
            while used.0 != 0 && used.0.saturating_add(bytes) > self.capacity {
                used.1 += 1;
                used = self.freed.wait(used).unwrap_or_else(|e| e.into_inner());
                used.1 -= 1;
            }
            used.0 = used.0.saturating_add(bytes);
        }
        BudgetGuard {
            budget: Arc::clone(self),
            bytes,
        }
    }

    /// Bytes currently taken.
    pub(crate) fn in_use(&self) -> usize {
        self.lock().0
    }

    /// Bytes it holds when full.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Bytes taken from a [`Budget`]; given back on drop.
#[derive(Debug)]
pub(crate) struct BudgetGuard {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Drop for BudgetGuard {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let mut used = self.budget.lock();
            used.0 = used.0.saturating_sub(self.bytes);
            let waiting = used.1 > 0;
            drop(used);
            // a wake-up system call only when someone waits for room
            if waiting {
                self.budget.freed.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn take_and_give_back() {
        let b = Budget::new(100);
        let g1 = b.acquire(60);
        let g2 = b.acquire(40);
        assert_eq!(b.in_use(), 100);
        drop(g1);
        assert_eq!(b.in_use(), 40);
        drop(g2);
        assert_eq!(b.in_use(), 0);
        let z = b.acquire(0);
        assert_eq!(b.in_use(), 0);
        drop(z);
    }

    #[test]
    fn waits_for_room() {
        let b = Budget::new(100);
        let g = b.acquire(80);
        let done = Arc::new(AtomicBool::new(false));
        let (b2, d2) = (Arc::clone(&b), Arc::clone(&done));
        let t = std::thread::spawn(move || {
            let _g = b2.acquire(50);
            d2.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!done.load(Ordering::SeqCst));
        drop(g);
        t.join().unwrap();
        assert!(done.load(Ordering::SeqCst));
        assert_eq!(b.in_use(), 0);
    }

    #[test]
    fn oversized_request_runs_alone() {
        let b = Budget::new(10);
        let g = b.acquire(1000);
        assert_eq!(b.in_use(), 1000);
        drop(g);
        let small = b.acquire(5);
        let done = Arc::new(AtomicBool::new(false));
        let (b2, d2) = (Arc::clone(&b), Arc::clone(&done));
        let t = std::thread::spawn(move || {
            let _g = b2.acquire(1000);
            d2.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!done.load(Ordering::SeqCst));
        drop(small);
        t.join().unwrap();
        assert_eq!(b.in_use(), 0);
    }
}
