//! Which blocks of a ledger's first half this process's threads own (a bit
//! each, in this process's memory); a thread's home ([`super::home`]) takes
//! one and gives it back when the thread ends.

use std::sync::atomic::{AtomicU64, Ordering};

/// Records in a thread's block: its spare's mirror and seven tickets.
pub(crate) const BLOCK: u32 = 8;

/// Which blocks of one ledger this process's threads own.
pub(crate) struct Blocks {
    words: Box<[AtomicU64]>,
    count: u32,
}

impl Blocks {
    pub(crate) fn new(ledger_len: u32) -> Blocks {
        let count = ledger_len / 2 / BLOCK;
        Blocks { words: (0..count.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(), count }
    }

    /// The first record of the ledger's shared half.
    pub(crate) fn shared_start(&self) -> u32 {
        self.count * BLOCK
    }

    pub(crate) fn take(&self) -> Option<u32> {
        for (i, w) in self.words.iter().enumerate() {
            let mut cur = w.load(Ordering::Relaxed);
            loop {
                let bit = (!cur).trailing_zeros();
                let block = i as u32 * 64 + bit;
                if bit == 64 || block >= self.count {
                    break;
                }
                match w.compare_exchange_weak(cur, cur | 1 << bit, Ordering::AcqRel, Ordering::Relaxed) {
                    Ok(_) => return Some(block),
                    Err(v) => cur = v,
                }
            }
        }
        None
    }

    pub(crate) fn give(&self, block: u32) {
        if let Some(w) = self.words.get(block as usize / 64) {
            w.fetch_and(!(1 << (block % 64)), Ordering::AcqRel);
        }
    }
}
