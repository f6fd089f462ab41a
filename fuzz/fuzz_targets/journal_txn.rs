//! Fuzz target: the journal transaction decoder
//! `dedupd_engine::journal::decode_txn`.
//!
//! The input is decoded as it is (almost always rejected: a random
//! checksum rarely matches), and once more with the transaction magic, the
//! body length, the record count (reduced to at most what the body can
//! hold, plus one) and the CRC32C patched so that the whole input is a
//! transaction with a good checksum — that copy reaches the record parser.
//! Whatever decodes is encoded again with `encode_txn` and must decode to
//! the same sequence number and operations, and any prefix of a valid
//! encoding (a torn write) must be rejected.
#![no_main]

use dedupd_engine::journal::{decode_txn, encode_txn};
use libfuzzer_sys::fuzz_target;

/// Transaction header: magic, sequence, record count, body length.
const HEADER_BYTES: usize = 8 + 8 + 4 + 8;
/// Magic of a transaction header (little endian on disk).
const MAGIC: &[u8; 8] = b"DDJTXN01";

fuzz_target!(|data: &[u8]| {
    check(data);
    if let Some(fixed) = with_good_checksum(data) {
        check(&fixed);
    }
});

fn check(bytes: &[u8]) {
    let Ok(txn) = decode_txn(bytes) else {
        return;
    };
    assert!(txn.len_bytes as usize <= bytes.len());
    let again = encode_txn(txn.seq, &txn.ops);
    let back = decode_txn(&again).expect("an encoded transaction decodes");
    assert_eq!(back.seq, txn.seq);
    assert_eq!(back.ops, txn.ops);
    assert_eq!(back.len_bytes, again.len() as u64);
    // a torn copy of it is never accepted
    for cut in [0, 1, HEADER_BYTES, again.len() / 2, again.len() - 1] {
        if cut < again.len() {
            assert!(
                decode_txn(&again[..cut]).is_err(),
                "torn transaction ({cut} of {} bytes) accepted",
                again.len()
            );
        }
    }
}

/// The input with the magic set, the body length covering everything up to
/// a final CRC32C, and that CRC computed: `None` if too short.
fn with_good_checksum(data: &[u8]) -> Option<Vec<u8>> {
    if data.len() < HEADER_BYTES + 4 {
        return None;
    }
    let mut b = data.to_vec();
    b[0..8].copy_from_slice(MAGIC);
    let body = (b.len() - HEADER_BYTES - 4) as u64;
    b[20..28].copy_from_slice(&body.to_le_bytes());
    // Keep the record count near what the body can hold (a record is at
    // least 18 bytes), so that most inputs get past the count and reach
    // the record decoder (decode_txn reserves at most one record per 18
    // body bytes).
    let count = u32::from_le_bytes([b[16], b[17], b[18], b[19]]);
    let count = count % (body as u32 / 18 + 2);
    b[16..20].copy_from_slice(&count.to_le_bytes());
    let n = b.len();
    let crc = crc32c::crc32c(&b[..n - 4]);
    b[n - 4..].copy_from_slice(&crc.to_le_bytes());
    Some(b)
}
