//! A byte budget bounding the payload memory of in-flight requests.
//!
//! Shared by every connection of a server. A request takes its share before
//! its buffer is allocated and gives it back when its reply has been sent
//! (by dropping the [`BudgetGuard`]).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Counting budget of bytes, blocking when exhausted. Waiters are served
/// in arrival order, so a large request is not passed over for ever by
/// smaller ones arriving after it.
#[derive(Debug)]
pub(crate) struct Budget {
    capacity: usize,
    state: Mutex<State>,
    freed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// Bytes taken.
    used: usize,
    /// Most bytes taken at once since the budget was made.
    peak: usize,
    /// Ticket the next request gets.
    next_ticket: u64,
    /// Ticket whose turn it is.
    serving: u64,
    /// Threads waiting for their turn or for room.
    waiting: usize,
}

impl Budget {
    /// A budget of `capacity` bytes.
    pub(crate) fn new(capacity: usize) -> Arc<Budget> {
        Arc::new(Budget {
            capacity,
            state: Mutex::new(State::default()),
            freed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `bytes` from the budget, waiting until they are available and
    /// every request that waited before this one has taken its share. A
    /// request larger than the whole budget waits until nothing else is in
    /// flight and then proceeds alone.
    pub(crate) fn acquire(self: &Arc<Self>, bytes: usize) -> BudgetGuard {
        if bytes > 0 {
            let mut s = self.lock();
            let ticket = s.next_ticket;
            s.next_ticket += 1;
            while s.serving != ticket
                || (s.used != 0 && s.used.saturating_add(bytes) > self.capacity)
            {
                s.waiting += 1;
                s = self.freed.wait(s).unwrap_or_else(|e| e.into_inner());
                s.waiting -= 1;
            }
            s.used = s.used.saturating_add(bytes);
            s.peak = s.peak.max(s.used);
            s.serving += 1;
            // the next in line may fit too
            let waiting = s.waiting > 0;
            drop(s);
            if waiting {
                self.freed.notify_all();
            }
        }
        BudgetGuard {
            budget: Arc::clone(self),
            bytes,
        }
    }

    /// Bytes currently taken.
    pub(crate) fn in_use(&self) -> usize {
        self.lock().used
    }

    /// Most bytes taken at once since the budget was made (at most the
    /// capacity, or one larger request's bytes taken alone).
    pub(crate) fn peak(&self) -> usize {
        self.lock().peak
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
            let mut s = self.budget.lock();
            s.used = s.used.saturating_sub(self.bytes);
            let waiting = s.waiting > 0;
            drop(s);
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
        assert_eq!(b.peak(), 100);
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
    fn a_waiting_request_is_not_passed_by_later_ones() {
        let b = Budget::new(100);
        let g = b.acquire(60);
        let order = Arc::new(Mutex::new(Vec::new()));
        let spawn = |name: &'static str, bytes: usize| {
            let (b, order) = (Arc::clone(&b), Arc::clone(&order));
            std::thread::spawn(move || {
                let g = b.acquire(bytes);
                order.lock().unwrap().push(name);
                std::thread::sleep(Duration::from_millis(50));
                drop(g);
            })
        };
        // 70 does not fit beside 60; 35 would, but comes after it (and
        // does not fit beside 70: it starts once the large one is done, so
        // the order recorded does not depend on the scheduler)
        let waiting = |n: usize| {
            while b.lock().waiting != n {
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        let large = spawn("large", 70);
        waiting(1);
        let small = spawn("small", 35);
        waiting(2);
        assert!(
            order.lock().unwrap().is_empty(),
            "{:?}",
            order.lock().unwrap()
        );
        drop(g);
        large.join().unwrap();
        small.join().unwrap();
        assert_eq!(*order.lock().unwrap(), ["large", "small"]);
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
