//! Property tests: arbitrary bytes fed to the decoders, to the handshake and
//! to the transmission phase never panic.

use std::io::Cursor;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use crate::budget::Budget;
use crate::export::{Export, ExportError, ExportInfo, ExportProvider};
use crate::handshake::{negotiate, Outcome};
use crate::proto;
use crate::transmission::{run, ReplySink, ReplyWriter, RequestSource, Resources};

struct Mem(Mutex<Vec<u8>>);

impl Export for Mem {
    fn size_bytes(&self) -> u64 {
        self.0.lock().unwrap().len() as u64
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        let d = self.0.lock().unwrap();
        let o = offset as usize;
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), ExportError> {
        let mut d = self.0.lock().unwrap();
        let o = offset as usize;
        d[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        self.write_zeroes(offset, len, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, _fua: bool) -> Result<(), ExportError> {
        let mut d = self.0.lock().unwrap();
        d[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

struct One(Arc<Mem>);

impl ExportProvider for One {
    fn list(&self) -> Vec<ExportInfo> {
        vec![ExportInfo {
            name: "a".into(),
            description: "test".into(),
        }]
    }
    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        (name.is_empty() || name == "a").then(|| Arc::clone(&self.0) as Arc<dyn Export>)
    }
    fn flush_covers_all_connections(&self) -> bool {
        true
    }
}

fn mem(size: usize) -> Arc<Mem> {
    Arc::new(Mem(Mutex::new(vec![0u8; size])))
}

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ReplySink for Sink {}

impl RequestSource for Cursor<&[u8]> {
    fn input_pending(&mut self) -> bool {
        true
    }
}

fn run_transmission(input: &[u8]) -> Vec<u8> {
    let sink = Sink::default();
    let writer = Arc::new(ReplyWriter::new(Box::new(sink.clone()), Box::new(|| {})));
    let budget = Budget::new(1 << 20);
    let (requests, stopping) = (AtomicU64::new(0), AtomicBool::new(false));
    let kept = AtomicU64::new(0);
    let res = Resources {
        workers: 2,
        max_payload: proto::BLOCK_SIZE_MAX,
        budget: &budget,
        requests_total: &requests,
        stopping: &stopping,
        kept_buffer_bytes: &kept,
    };
    run(&mut Cursor::new(input), writer, mem(64 * 1024), &res);
    assert_eq!(budget.in_use(), 0);
    assert_eq!(kept.load(std::sync::atomic::Ordering::Relaxed), 0);
    let out = sink.0.lock().unwrap().clone();
    out
}

fn request(flags: u16, cmd: u16, handle: u64, offset: u64, len: u32) -> Vec<u8> {
    proto::encode_request(flags, cmd, handle, offset, len).to_vec()
}

fn arb_request() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u16>(),
        prop_oneof![0u16..8, any::<u16>()],
        any::<u64>(),
        prop_oneof![0u64..70_000, any::<u64>()],
        prop_oneof![0u32..5000, any::<u32>()],
        prop::collection::vec(any::<u8>(), 0..300),
    )
        .prop_map(|(f, c, h, o, l, tail)| {
            let mut b = request(f, c, h, o, l);
            b.extend_from_slice(&tail);
            b
        })
}

fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut b = proto::IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

fn arb_option() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![0u32..12, any::<u32>()],
        prop::collection::vec(any::<u8>(), 0..64),
        any::<bool>(),
    )
        .prop_map(|(o, data, raw_len)| {
            if raw_len {
                // A header whose length field is unrelated to what follows.
                let mut b = proto::IHAVEOPT.to_be_bytes().to_vec();
                b.extend_from_slice(&o.to_be_bytes());
                b.extend_from_slice(&data);
                b
            } else {
                option(o, &data)
            }
        })
}

fn handshake(input: &[u8]) {
    let provider = One(mem(4096));
    let mut out = Vec::new();
    let stopping = AtomicBool::new(false);
    let _ = negotiate(
        &mut Cursor::new(input),
        &mut out,
        proto::BLOCK_SIZE_MAX,
        &provider,
        &stopping,
        &AtomicBool::new(false),
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn decoders_never_panic(b in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = proto::decode_client_flags(&b);
        let _ = proto::decode_option_header(&b);
        let _ = proto::decode_info_request(&b);
        let _ = proto::decode_export_name(&b);
        let _ = proto::decode_request(&b);
    }

    #[test]
    fn handshake_never_panics_on_random_bytes(b in prop::collection::vec(any::<u8>(), 0..300)) {
        handshake(&b);
    }

    #[test]
    fn handshake_never_panics_on_random_options(
        flags in prop_oneof![Just(3u32), any::<u32>()],
        opts in prop::collection::vec(arb_option(), 0..6),
    ) {
        let mut input = flags.to_be_bytes().to_vec();
        for o in opts {
            input.extend_from_slice(&o);
        }
        handshake(&input);
    }

    #[test]
    fn transmission_never_panics_on_random_bytes(b in prop::collection::vec(any::<u8>(), 0..300)) {
        run_transmission(&b);
    }

    #[test]
    fn transmission_never_panics_on_random_requests(
        reqs in prop::collection::vec(arb_request(), 0..8),
    ) {
        let input: Vec<u8> = reqs.concat();
        let out = run_transmission(&input);
        // Whatever came out starts with a simple reply.
        prop_assert!(out.is_empty() || out[0..4] == proto::SIMPLE_REPLY_MAGIC.to_be_bytes());
    }
}

#[test]
fn handshake_go_then_transmission_roundtrip() {
    // GO for the default export, then read past the end and a valid write.
    let mut input = 3u32.to_be_bytes().to_vec();
    let mut go = 0u32.to_be_bytes().to_vec();
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
    input.extend_from_slice(&option(proto::OPT_GO, &go));
    let provider = One(mem(4096));
    let mut out = Vec::new();
    let stopping = AtomicBool::new(false);
    let mut cur = Cursor::new(&input[..]);
    let r = negotiate(
        &mut cur,
        &mut out,
        proto::BLOCK_SIZE_MAX,
        &provider,
        &stopping,
        &AtomicBool::new(false),
    )
    .unwrap();
    assert!(matches!(r, Outcome::Transmission { .. }));
    // greeting + INFO_EXPORT + BLOCK_SIZE + ACK
    assert_eq!(out.len(), 18 + (20 + 12) + (20 + 14) + 20);

    let mut t = request(0, proto::CMD_READ, 9, 65_500, 200);
    t.extend_from_slice(&request(0, proto::CMD_WRITE, 10, 0, 4));
    t.extend_from_slice(b"abcd");
    t.extend_from_slice(&request(0, proto::CMD_READ, 11, 0, 4));
    let out = run_transmission(&t);
    assert_eq!(out.len(), 16 * 3 + 4);
}

#[test]
fn oversized_option_is_discarded_not_allocated() {
    let mut input = 3u32.to_be_bytes().to_vec();
    let mut hdr = proto::IHAVEOPT.to_be_bytes().to_vec();
    hdr.extend_from_slice(&proto::OPT_GO.to_be_bytes());
    hdr.extend_from_slice(&(100_000u32).to_be_bytes());
    input.extend_from_slice(&hdr);
    input.extend_from_slice(&vec![0u8; 100_000]);
    input.extend_from_slice(&option(proto::OPT_ABORT, &[]));
    let provider = One(mem(4096));
    let mut out = Vec::new();
    let stopping = AtomicBool::new(false);
    let r = negotiate(
        &mut Cursor::new(&input[..]),
        &mut out,
        proto::BLOCK_SIZE_MAX,
        &provider,
        &stopping,
        &AtomicBool::new(false),
    )
    .unwrap();
    assert!(matches!(r, Outcome::Closed));
    let first = &out[18..];
    assert_eq!(&first[12..16], &proto::REP_ERR_TOO_BIG.to_be_bytes());
    let len = u32::from_be_bytes([first[16], first[17], first[18], first[19]]) as usize;
    let second = &first[20 + len..];
    assert_eq!(&second[12..16], &proto::REP_ACK.to_be_bytes());
}

#[test]
fn option_data_is_read_up_to_8_kib() {
    // GO for the longest name the spec allows (4096 bytes, unknown here):
    // read and answered UNKNOWN; then option data one byte over 8 KiB:
    // TOO_BIG without being read into memory
    let mut input = 3u32.to_be_bytes().to_vec();
    let name = vec![b'n'; proto::MAX_STRING_LEN];
    let mut go = (name.len() as u32).to_be_bytes().to_vec();
    go.extend_from_slice(&name);
    go.extend_from_slice(&0u16.to_be_bytes());
    input.extend_from_slice(&option(proto::OPT_GO, &go));
    let over = proto::MAX_OPTION_DATA_LEN as usize + 1;
    let mut long = ((over - 6) as u32).to_be_bytes().to_vec();
    long.extend_from_slice(&vec![b'm'; over - 6]);
    long.extend_from_slice(&0u16.to_be_bytes());
    input.extend_from_slice(&option(proto::OPT_GO, &long));
    input.extend_from_slice(&option(proto::OPT_ABORT, &[]));
    let provider = One(mem(4096));
    let mut out = Vec::new();
    let r = negotiate(
        &mut Cursor::new(&input[..]),
        &mut out,
        proto::BLOCK_SIZE_MAX,
        &provider,
        &AtomicBool::new(false),
        &AtomicBool::new(false),
    )
    .unwrap();
    assert!(matches!(r, Outcome::Closed));
    let mut replies = Vec::new();
    let mut rest = &out[18..];
    while rest.len() >= 20 {
        replies.push(u32::from_be_bytes(rest[12..16].try_into().unwrap()));
        let len = u32::from_be_bytes(rest[16..20].try_into().unwrap()) as usize;
        rest = &rest[20 + len..];
    }
    assert_eq!(
        replies,
        [
            proto::REP_ERR_UNKNOWN,
            proto::REP_ERR_TOO_BIG,
            proto::REP_ACK
        ]
    );
}
