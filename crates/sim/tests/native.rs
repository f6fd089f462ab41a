//! Native format: round trip (proptest) and corruption detection.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use dedupd_sim::native::NativeWriter;
use dedupd_sim::{Op, Request, Source, TraceError, TraceReader};
use proptest::prelude::*;

fn arb_request(sources: u32) -> impl Strategy<Value = Request> {
    (
        any::<u64>(),
        0..sources,
        prop_oneof![Just(Op::Read), Just(Op::Write), Just(Op::Trim)],
        prop_oneof![
            0..1u64 << 20,
            0..dedupd_sim::request::MAX_END_SECTORS - 4096
        ],
        1..4096u64,
        prop::collection::vec(prop::option::of(any::<[u8; 16]>()), 0..40),
    )
        .prop_map(|(ts_ns, source, op, lba_sectors, sectors, mut blocks)| {
            let mut r = Request {
                ts_ns,
                source,
                op: Some(op),
                lba_sectors,
                sectors,
                blocks: Vec::new(),
            };
            // a write carries a digest (or zero mark) per block it touches
            if op == Op::Write {
                blocks.resize(r.blocks_touched() as usize, None);
            }
            r.blocks = blocks;
            r
        })
}

fn encode(sources: &[Source], reqs: &[Request]) -> Vec<u8> {
    let mut w = NativeWriter::new(Vec::new()).unwrap();
    for s in sources {
        w.define_source(s).unwrap();
    }
    for r in reqs {
        w.write(r).unwrap();
    }
    w.finish().unwrap()
}

fn decode(bytes: &[u8]) -> Result<(Vec<Source>, Vec<Request>), TraceError> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.ddt");
    std::fs::write(&p, bytes).unwrap();
    let mut r = TraceReader::open(&p, None, false, Arc::new(AtomicU64::new(0)))?;
    let mut out = Vec::new();
    let mut q = Request::default();
    while r.next_into(&mut q)? {
        out.push(q.clone());
    }
    Ok((r.sources().to_vec(), out))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn write_then_read_back_is_identity(
        names in prop::collection::vec(
            ("[a-z ./]{0,20}", any::<u32>(), prop_oneof![Just(0u64), any::<u64>()]),
            1..5,
        ),
        seed_reqs in prop::collection::vec(arb_request(5), 0..3000),
    ) {
        let sources: Vec<Source> = names
            .into_iter()
            .map(|(process, pid, device)| Source { pid, process, device })
            .collect();
        let reqs: Vec<Request> = seed_reqs
            .into_iter()
            .map(|mut r| { r.source %= sources.len() as u32; r })
            .collect();
        let bytes = encode(&sources, &reqs);
        let (s2, r2) = decode(&bytes).unwrap();
        prop_assert_eq!(s2, sources);
        prop_assert_eq!(r2, reqs);
    }
}

/// One source, and `n` one-block writes from it at consecutive blocks.
fn one_block_writes(n: u64) -> ([Source; 1], Vec<Request>) {
    let src = [Source {
        pid: 1,
        process: "p".into(),
        device: 0,
    }];
    let reqs = (0..n)
        .map(|i| Request {
            ts_ns: i,
            source: 0,
            op: Some(Op::Write),
            lba_sectors: i * 8,
            sectors: 8,
            blocks: vec![Some([i as u8; 16])],
        })
        .collect();
    (src, reqs)
}

#[test]
fn corruption_and_truncation_are_detected() {
    let (src, reqs) = one_block_writes(100);
    let good = encode(&src, &reqs);
    assert_eq!(decode(&good).unwrap().1.len(), 100);
    let mut flipped = good.clone();
    flipped[40] ^= 0x10;
    let e = decode(&flipped).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    let e = decode(&good[..good.len() - 20]).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
    let mut next = good.clone();
    next[8..10].copy_from_slice(&(dedupd_sim::native::VERSION + 1).to_le_bytes());
    let e = decode(&next).unwrap_err();
    assert!(e.to_string().contains("version"), "{e}");
    let mut flags = good.clone();
    flags[10] = 1;
    let e = decode(&flags).unwrap_err();
    assert!(e.to_string().contains("reserved"), "{e}");
    // two traces concatenated: not the first alone, silently
    let twice = [good.clone(), good.clone()].concat();
    let e = decode(&twice).unwrap_err();
    assert!(e.to_string().contains("after the end marker"), "{e}");
    // the offset named is where the extra data starts
    match decode(&[good.clone(), vec![b'X']].concat()).unwrap_err() {
        TraceError::BadNative { offset, .. } => assert_eq!(offset, good.len() as u64),
        e => panic!("{e}"),
    }
}

/// A compressed native trace cut short in a chunk: the decompressor's
/// error is said, not taken for the end of the trace.
#[test]
fn a_cut_compressed_native_trace_says_the_compression_is_cut() {
    let (src, reqs) = one_block_writes(20_000);
    let good = encode(&src, &reqs);
    let zst = zstd::encode_all(&good[..], 1).unwrap();
    let e = decode(&zst[..zst.len() / 2]).unwrap_err();
    assert!(
        e.to_string().contains("zstd data is corrupt or cut short"),
        "{e}"
    );
    // uncompressed, cut in a chunk: truncated
    let e = decode(&good[..good.len() / 2]).unwrap_err();
    assert!(e.to_string().contains("truncated chunk"), "{e}");
}

#[test]
fn a_varint_past_64_bits_is_refused() {
    // a source record, then a write whose LBA varint is 10 bytes with a
    // last byte over 1 (bit 64 and up), in a chunk of its own
    let mut payload = vec![0x01, 0x00, 0x01, 0x01, b'p'];
    payload.extend([0x03, 0x00, 0x00]);
    payload.extend([0x80; 9]);
    payload.push(0x02);
    payload.extend([0x08, 0x01, 0x01]);
    payload.extend([0x11; 16]);
    let mut bytes = b"DDTRACE\0".to_vec();
    bytes.extend(1u16.to_le_bytes());
    bytes.extend([0u8; 6]);
    bytes.extend((payload.len() as u32).to_le_bytes());
    bytes.extend(crc32c::crc32c(&payload).to_le_bytes());
    bytes.extend(&payload);
    bytes.extend(0u32.to_le_bytes());
    bytes.extend(2u64.to_le_bytes());
    bytes.extend(crc32c::crc32c(&2u64.to_le_bytes()).to_le_bytes());
    let e = decode(&bytes).unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
}

#[test]
fn requests_no_reader_could_use_are_refused() {
    let src = [Source {
        pid: 1,
        process: "p".into(),
        device: 0,
    }];
    let req = |op, lba_sectors, sectors, blocks: usize| Request {
        ts_ns: 1,
        source: 0,
        op: Some(op),
        lba_sectors,
        sectors,
        blocks: vec![Some([7u8; 16]); blocks],
    };
    for (bad, why) in [
        (req(Op::Write, 0, 0, 2), "size is 0"),
        (req(Op::Trim, 8, u64::MAX, 0), "address space"),
        (req(Op::Read, u64::MAX, 1, 0), "address space"),
        (req(Op::Write, 0, 8, 3), "digests do not fit"),
    ] {
        let bytes = encode(&src, &[req(Op::Write, 0, 8, 1), bad]);
        let err = decode(&bytes).unwrap_err();
        assert!(
            matches!(err, TraceError::BadNative { .. }) && err.to_string().contains(why),
            "{err}"
        );
    }
}

#[test]
fn a_replayed_trim_unmaps_whole_blocks_only() {
    let w = |lba_sectors, sectors, blocks: Vec<Option<[u8; 16]>>, op| Request {
        ts_ns: 0,
        source: 0,
        op: Some(op),
        lba_sectors,
        sectors,
        blocks,
    };
    let bytes = encode(
        &[Source {
            pid: 1,
            process: "p".into(),
            device: 0,
        }],
        &[
            // blocks 0 and 1, then a trim of sectors 4..12 (part of each)
            w(0, 16, vec![Some([1; 16]), Some([2; 16])], Op::Write),
            w(4, 8, Vec::new(), Op::Trim),
            // block 2, then a trim of sectors 12..24 (the rest of block 1
            // and all of block 2)
            w(16, 8, vec![Some([3; 16])], Op::Write),
            w(12, 12, Vec::new(), Op::Trim),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.ddt");
    std::fs::write(&p, bytes).unwrap();
    let cfg = dedupd_sim::ReplayConfig::default();
    let r = dedupd_sim::replay(&[p], &cfg, &mut |_| {}).unwrap();
    assert_eq!(r.blocks_written, 3);
    assert_eq!(r.zero_blocks_written, 0);
    // blocks 0 and 1 stay (only parts of them were trimmed), 2 is gone
    assert_eq!(r.mapped_blocks, 2);
    assert_eq!(r.trims, 2);
}

#[test]
fn a_large_record_after_small_ones_starts_a_chunk_of_its_own() {
    // about 60 KiB of small records, then one write of 61 000 digests
    // (1.04 MB): it fits a chunk alone, not with them
    let (src, mut reqs) = one_block_writes(2000);
    reqs.push(Request {
        ts_ns: 5000,
        source: 0,
        op: Some(Op::Write),
        lba_sectors: 1 << 30,
        sectors: 61_000 * 8,
        blocks: (0..61_000u32)
            .map(|i| Some([(i % 251) as u8; 16]))
            .collect(),
    });
    let bytes = encode(&src, &reqs);
    let (_, back) = decode(&bytes).unwrap();
    assert_eq!(back, reqs);
}

#[test]
fn a_conversion_keeps_sources_defined_after_the_last_request() {
    let (src, reqs) = one_block_writes(3);
    let mut w = NativeWriter::new(Vec::new()).unwrap();
    w.define_source(&src[0]).unwrap();
    for r in &reqs {
        w.write(r).unwrap();
    }
    let late = Source {
        pid: 2,
        process: "late".into(),
        device: 0,
    };
    w.define_source(&late).unwrap();
    let bytes = w.finish().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.ddt"), dir.path().join("out.ddt"));
    std::fs::write(&input, &bytes).unwrap();
    let summary = dedupd_sim::convert(&input, None, false, &output).unwrap();
    assert_eq!((summary.requests, summary.sources), (3, 2));
    let (sources, converted) = decode(&std::fs::read(&output).unwrap()).unwrap();
    assert_eq!(sources, vec![src[0].clone(), late]);
    assert_eq!(converted, reqs);
}

#[test]
fn version_1_files_still_read() {
    let (src, reqs) = one_block_writes(3);
    let mut bytes = encode(&src, &reqs);
    assert_eq!(
        u16::from_le_bytes([bytes[8], bytes[9]]),
        dedupd_sim::native::VERSION
    );
    assert_eq!(dedupd_sim::native::VERSION, 2);
    // a trace without device numbers is a valid version 1 file (the
    // header is outside the checksums)
    bytes[8..10].copy_from_slice(&1u16.to_le_bytes());
    let (sources, back) = decode(&bytes).unwrap();
    assert_eq!(sources, src);
    assert_eq!(back, reqs);
    bytes[8..10].copy_from_slice(&3u16.to_le_bytes());
    let e = decode(&bytes).unwrap_err();
    assert!(e.to_string().contains("unsupported version 3"), "{e}");
}

#[test]
fn devices_round_trip_and_only_they_take_the_device_record() {
    let (_, reqs) = one_block_writes(4);
    let plain = Source {
        pid: 1,
        process: "p".into(),
        device: 0,
    };
    let on_disk = |device| Source {
        device,
        ..plain.clone()
    };
    let sources = [plain.clone(), on_disk(6 << 32 | 16), on_disk(u64::MAX)];
    let reqs: Vec<Request> = reqs
        .into_iter()
        .enumerate()
        .map(|(i, r)| Request {
            source: (i % 3) as u32,
            ..r
        })
        .collect();
    let bytes = encode(&sources, &reqs);
    let (back_sources, back) = decode(&bytes).unwrap();
    assert_eq!(back_sources, sources);
    assert_eq!(back, reqs);
    // a source without a device is a version 1 source record (tag 0x01,
    // first in the first chunk's payload); one with a device is not, and
    // is refused in a version 1 file
    let first_tag = |s: &Source| encode(std::slice::from_ref(s), &[])[HEADER + 8];
    assert_eq!(first_tag(&plain), 0x01);
    assert_eq!(first_tag(&on_disk(1)), 0x05);
    let mut v1 = bytes.clone();
    v1[8..10].copy_from_slice(&1u16.to_le_bytes());
    let e = decode(&v1).unwrap_err();
    assert!(e.to_string().contains("0x05"), "{e}");
}

/// Bytes of the header (payloads follow it).
const HEADER: usize = dedupd_sim::native::HEADER_BYTES;
