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
        any::<u64>(),
        any::<u64>(),
        prop::collection::vec(prop::option::of(any::<[u8; 16]>()), 0..40),
    )
        .prop_map(
            |(ts_ns, source, op, lba_sectors, sectors, blocks)| Request {
                ts_ns,
                source,
                op: Some(op),
                lba_sectors,
                sectors,
                blocks,
            },
        )
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
        names in prop::collection::vec(("[a-z ./]{0,20}", any::<u32>()), 1..5),
        seed_reqs in prop::collection::vec(arb_request(5), 0..3000),
    ) {
        let sources: Vec<Source> = names
            .into_iter()
            .map(|(process, pid)| Source { pid, process })
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

#[test]
fn corruption_and_truncation_are_detected() {
    let src = [Source {
        pid: 1,
        process: "p".into(),
    }];
    let reqs: Vec<Request> = (0..100)
        .map(|i| Request {
            ts_ns: i,
            source: 0,
            op: Some(Op::Write),
            lba_sectors: i * 8,
            sectors: 8,
            blocks: vec![Some([i as u8; 16])],
        })
        .collect();
    let good = encode(&src, &reqs);
    assert_eq!(decode(&good).unwrap().1.len(), 100);
    let mut flipped = good.clone();
    flipped[40] ^= 0x10;
    let e = decode(&flipped).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    let e = decode(&good[..good.len() - 20]).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
    let mut v2 = good.clone();
    v2[8] = 2;
    let e = decode(&v2).unwrap_err();
    assert!(e.to_string().contains("version"), "{e}");
}
