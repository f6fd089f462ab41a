//! Block addressing: logical and physical block addresses, volume ids and
//! the block size.

use serde::{Deserialize, Serialize};

/// Size in bytes of one block (chunk), the unit of deduplication. Fixed per
/// store; this version supports 4 KiB only.
pub const BLOCK_SIZE: usize = 4096;

/// [`BLOCK_SIZE`] as a `u64`, for offset arithmetic.
pub const BLOCK_SIZE_U64: u64 = BLOCK_SIZE as u64;

/// Logical block address: a block number inside one volume (4 KiB units).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Lba(pub u64);

/// Physical block address: a block number in the store's data file
/// (4 KiB units; byte offset = PBA × 4096).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Pba(pub u64);

/// Identifier of a volume inside a store; stable for the volume's life and
/// never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct VolumeId(pub u32);

/// True if every byte of `block` is zero.
pub fn is_zero(block: &[u8]) -> bool {
    // Compare 8 bytes at a time; the tail (if any) byte by byte.
    let (prefix, words, suffix) = unsafe { block.align_to::<u64>() };
    prefix.iter().all(|&b| b == 0)
        && words.iter().all(|&w| w == 0)
        && suffix.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection() {
        let mut b = vec![0u8; BLOCK_SIZE];
        assert!(is_zero(&b));
        b[4095] = 1;
        assert!(!is_zero(&b));
        b[4095] = 0;
        b[0] = 1;
        assert!(!is_zero(&b));
        assert!(is_zero(&b[1..]));
    }
}
