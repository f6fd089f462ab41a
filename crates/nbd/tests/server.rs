//! In-process integration tests: a running server and a hand-written client.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::net::Shutdown;
use std::time::{Duration, Instant};

use common::{request_bytes, Client, Harness, DISK_SIZE};
use dedupd_nbd::proto::{self, *};
use dedupd_nbd::ServerConfig;

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn go_and_basic_io_over_tcp() {
    let h = Harness::start(ServerConfig::default());
    let mut c = h.tcp();
    let (size, flags) = c.connect_go("disk");
    assert_eq!(size, DISK_SIZE as u64);
    for f in [
        TFLAG_HAS_FLAGS,
        TFLAG_SEND_FLUSH,
        TFLAG_SEND_FUA,
        TFLAG_SEND_TRIM,
        TFLAG_SEND_WRITE_ZEROES,
        TFLAG_CAN_MULTI_CONN,
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} missing from {flags:#x}");
    }
    assert_eq!(flags & TFLAG_READ_ONLY, 0);

    // Write (with FUA) and read back.
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(c.simple(CMD_FLAG_FUA, CMD_WRITE, 4096, 8192, &data), 0);
    assert_eq!(c.read(4096, 8192).unwrap(), data);
    assert_eq!(
        &h.provider.disk.data.lock().unwrap()[4096..4096 + 8192],
        &data[..]
    );

    // Trim, then zeros read back.
    assert_eq!(c.simple(0, CMD_TRIM, 4096, 4096, &[]), 0);
    assert_eq!(c.read(4096, 4096).unwrap(), vec![0u8; 4096]);
    assert_eq!(c.read(8192, 4096).unwrap(), data[4096..].to_vec());

    // Write zeroes with NO_HOLE and FUA.
    assert_eq!(
        c.simple(
            CMD_FLAG_NO_HOLE | CMD_FLAG_FUA,
            CMD_WRITE_ZEROES,
            8192,
            4096,
            &[]
        ),
        0
    );
    assert_eq!(c.read(8192, 4096).unwrap(), vec![0u8; 4096]);

    // Flush.
    assert_eq!(c.simple(0, CMD_FLUSH, 0, 0, &[]), 0);
    assert!(*h.provider.disk.flushes.lock().unwrap() >= 1);

    // Past the end: EINVAL for READ and TRIM, ENOSPC for WRITE and
    // WRITE_ZEROES (proto.md "Error values"); WRITE payload is skipped.
    let end = DISK_SIZE as u64;
    assert_eq!(c.read(end - 10, 11), Err(NBD_EINVAL));
    assert_eq!(c.read(u64::MAX - 1, 4), Err(NBD_EINVAL));
    assert_eq!(c.simple(0, CMD_WRITE, end, 3, b"xyz"), NBD_ENOSPC);
    assert_eq!(c.simple(0, CMD_TRIM, end - 1, 2, &[]), NBD_EINVAL);
    assert_eq!(c.simple(0, CMD_WRITE_ZEROES, end, 1, &[]), NBD_ENOSPC);
    // The stream is still in sync after the refused write.
    assert_eq!(c.read(end - 4, 4).unwrap(), vec![0u8; 4]);

    // Unknown command -> EINVAL (no payload assumed), unknown flags -> EINVAL.
    assert_eq!(c.simple(0, 99, 0, 4096, &[]), NBD_EINVAL);
    assert_eq!(c.simple(1 << 7, CMD_READ, 0, 1, &[]), NBD_EINVAL);
    assert_eq!(c.simple(1 << 7, CMD_WRITE, 0, 2, b"ab"), NBD_EINVAL);
    assert_eq!(c.read(0, 2).unwrap(), vec![0u8; 2]);

    // Longer than 32 MiB: EINVAL for READ; TRIM and WRITE_ZEROES that
    // long are past this 8 MiB export's end.
    let big = BLOCK_SIZE_MAX + 1;
    assert_eq!(c.read(0, big), Err(NBD_EINVAL));
    assert_eq!(c.simple(0, CMD_TRIM, 0, big, &[]), NBD_EINVAL);
    assert_eq!(c.simple(0, CMD_WRITE_ZEROES, 0, big, &[]), NBD_ENOSPC);

    // Zero-length requests succeed.
    assert_eq!(c.read(0, 0).unwrap(), Vec::<u8>::new());
    assert_eq!(c.simple(0, CMD_WRITE, 0, 0, &[]), 0);

    // Soft disconnect: the server closes after DISC.
    c.send_request(0, CMD_DISC, 1, 0, 0, &[]);
    assert!(c.at_eof());
    wait_until("connection close", || {
        h.server.stats().connections_open == 0
    });
    let stats = h.server.stats();
    assert!(stats.requests_total >= 20, "{stats:?}");
    wait_until("budget returned", || h.server.stats().inflight_bytes == 0);
    h.stop();
}

#[test]
fn export_errors_are_mapped() {
    let h = Harness::start(ServerConfig::default());
    let mut c = h.tcp();
    c.connect_go("full");
    assert_eq!(c.read(0, 10), Err(NBD_EIO));
    assert_eq!(c.simple(0, CMD_WRITE, 0, 2, b"ab"), NBD_ENOSPC);
    assert_eq!(c.simple(0, CMD_TRIM, 0, 2, &[]), NBD_EINVAL);
    assert_eq!(c.simple(0, CMD_WRITE_ZEROES, 0, 2, &[]), NBD_EPERM);
    h.stop();
}

#[test]
fn read_only_export_refuses_writes() {
    let h = Harness::start(ServerConfig::default());
    let mut c = h.tcp();
    let (size, flags) = c.connect_go("ro");
    assert_eq!(size, 1 << 20);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(c.simple(0, CMD_WRITE, 0, 4, b"abcd"), NBD_EPERM);
    assert_eq!(c.simple(0, CMD_TRIM, 0, 4, &[]), NBD_EPERM);
    assert_eq!(c.simple(0, CMD_WRITE_ZEROES, 0, 4, &[]), NBD_EPERM);
    assert_eq!(c.simple(0, CMD_FLUSH, 0, 0, &[]), 0);
    assert_eq!(c.read(0, 4).unwrap(), vec![0; 4]);
    h.stop();
}

#[test]
fn pipelined_requests_all_answered_by_handle() {
    let h = Harness::start(ServerConfig::default());
    let mut c = h.tcp();
    c.connect_go("");
    let n = 64u64;
    for i in 0..n {
        let payload = vec![i as u8; 4096];
        c.send_request(0, CMD_WRITE, 1000 + i, i * 4096, 4096, &payload);
    }
    let mut seen = HashMap::new();
    for _ in 0..n {
        let (err, handle) = c.reply();
        assert_eq!(err, 0);
        *seen.entry(handle).or_insert(0) += 1;
    }
    assert_eq!(seen.len() as u64, n);
    for i in 0..n {
        c.send_request(0, CMD_READ, 2000 + i, i * 4096, 4096, &[]);
    }
    for _ in 0..n {
        let (err, handle) = c.reply();
        assert_eq!(err, 0);
        let data = c.read_n(4096);
        let i = handle - 2000;
        assert!(data.iter().all(|&b| b == i as u8), "handle {handle}");
    }
    h.stop();
}

#[test]
fn replies_complete_out_of_order() {
    // A slow request does not block a fast one on the same connection.
    let h = Harness::start(ServerConfig::default());
    let mut slow = h.tcp();
    slow.connect_go("slow");
    // Both on the "slow" export, but the first is a 300 ms read, the second a flush.
    slow.send_request(0, CMD_READ, 1, 0, 512, &[]);
    slow.send_request(0, CMD_FLUSH, 2, 0, 0, &[]);
    let (err, first) = slow.reply();
    assert_eq!((err, first), (0, 2), "flush should overtake the slow read");
    let (err, second) = slow.reply();
    assert_eq!((err, second), (0, 1));
    slow.read_n(512);
    h.stop();
}

#[test]
fn options_list_info_unsupported_abort() {
    let h = Harness::start(ServerConfig::default());
    let mut c = h.tcp();
    c.greet(proto::FLAG_C_FIXED_NEWSTYLE);

    // LIST
    c.send_option(OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let r = c.option_reply();
        assert_eq!(r.option, OPT_LIST);
        if r.kind == REP_ACK {
            break;
        }
        assert_eq!(r.kind, REP_SERVER);
        let len = u32::from_be_bytes(r.data[0..4].try_into().unwrap()) as usize;
        names.push(String::from_utf8(r.data[4..4 + len].to_vec()).unwrap());
        assert!(!r.data[4 + len..].is_empty(), "description present");
    }
    assert_eq!(names, vec!["disk", "ro"]);

    // LIST with data -> INVALID
    c.send_option(OPT_LIST, b"x");
    assert_eq!(c.option_reply().kind, REP_ERR_INVALID);

    // INFO with name and description requested
    let (infos, fin) = c.info_or_go(
        OPT_INFO,
        "ro",
        &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE],
    );
    assert_eq!(fin.kind, REP_ACK);
    let by_type: HashMap<u16, Vec<u8>> = infos
        .iter()
        .map(|i| (u16::from_be_bytes([i[0], i[1]]), i[2..].to_vec()))
        .collect();
    assert_eq!(by_type[&INFO_NAME], b"ro");
    assert_eq!(by_type[&INFO_DESCRIPTION], b"read-only disk");
    let e = &by_type[&INFO_EXPORT];
    assert_eq!(u64::from_be_bytes(e[0..8].try_into().unwrap()), 1 << 20);
    assert_ne!(u16::from_be_bytes([e[8], e[9]]) & TFLAG_READ_ONLY, 0);
    let bs = &by_type[&INFO_BLOCK_SIZE];
    assert_eq!(u32::from_be_bytes(bs[0..4].try_into().unwrap()), 1);
    assert_eq!(u32::from_be_bytes(bs[4..8].try_into().unwrap()), 4096);
    assert_eq!(u32::from_be_bytes(bs[8..12].try_into().unwrap()), 32 << 20);

    // INFO for an unknown export
    let (infos, fin) = c.info_or_go(OPT_INFO, "nope", &[]);
    assert!(infos.is_empty());
    assert_eq!(fin.kind, REP_ERR_UNKNOWN);
    // GO for an unknown export keeps negotiating
    let (_, fin) = c.info_or_go(OPT_GO, "nope", &[]);
    assert_eq!(fin.kind, REP_ERR_UNKNOWN);

    // Malformed INFO
    c.send_option(OPT_INFO, &[0, 0, 0, 9, b'a']);
    assert_eq!(c.option_reply().kind, REP_ERR_INVALID);

    // Unsupported options
    for opt in [OPT_STRUCTURED_REPLY, OPT_STARTTLS, 10, 11, 200] {
        c.send_option(opt, &[]);
        let r = c.option_reply();
        assert_eq!((r.option, r.kind), (opt, REP_ERR_UNSUP));
    }

    // Absurd length: discarded, TOO_BIG, still in sync
    let mut hdr = IHAVEOPT.to_be_bytes().to_vec();
    hdr.extend_from_slice(&OPT_INFO.to_be_bytes());
    hdr.extend_from_slice(&(1u32 << 20).to_be_bytes());
    c.s.write_all(&hdr).unwrap();
    c.s.write_all(&vec![0u8; 1 << 20]).unwrap();
    assert_eq!(c.option_reply().kind, REP_ERR_TOO_BIG);
    // LIST takes no data, whatever its length
    let mut hdr = IHAVEOPT.to_be_bytes().to_vec();
    hdr.extend_from_slice(&OPT_LIST.to_be_bytes());
    hdr.extend_from_slice(&(1u32 << 20).to_be_bytes());
    c.s.write_all(&hdr).unwrap();
    c.s.write_all(&vec![0u8; 1 << 20]).unwrap();
    assert_eq!(c.option_reply().kind, REP_ERR_INVALID);

    // INFO_NAME of the default export (empty name) is its canonical name.
    let (infos, fin) = c.info_or_go(OPT_INFO, "", &[INFO_NAME, INFO_DESCRIPTION]);
    assert_eq!(fin.kind, REP_ACK);
    let by_type: HashMap<u16, Vec<u8>> = infos
        .iter()
        .map(|i| (u16::from_be_bytes([i[0], i[1]]), i[2..].to_vec()))
        .collect();
    assert_eq!(by_type[&INFO_NAME], b"disk");
    assert_eq!(by_type[&INFO_DESCRIPTION], b"memory disk");

    // ABORT: ACK, then the server closes
    c.send_option(OPT_ABORT, &[]);
    let r = c.option_reply();
    assert_eq!((r.option, r.kind), (OPT_ABORT, REP_ACK));
    assert!(c.at_eof());

    // ABORT carrying more data than any option may: still acknowledged
    // (proto.md: the server SHOULD ignore the data).
    let mut c = h.tcp();
    c.greet(proto::FLAG_C_FIXED_NEWSTYLE);
    c.send_option(OPT_ABORT, &vec![7u8; 70_000]);
    let r = c.option_reply();
    assert_eq!((r.option, r.kind), (OPT_ABORT, REP_ACK));
    assert!(c.at_eof());
    h.stop();
}

#[test]
fn export_name_with_and_without_zeroes() {
    let h = Harness::start(ServerConfig::default());
    for no_zeroes in [false, true] {
        let mut c = h.tcp();
        let flags = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
        c.greet(flags);
        c.send_option(OPT_EXPORT_NAME, b""); // default export
        let r = c.read_n(10);
        assert_eq!(
            u64::from_be_bytes(r[0..8].try_into().unwrap()),
            DISK_SIZE as u64
        );
        assert_ne!(u16::from_be_bytes([r[8], r[9]]) & TFLAG_HAS_FLAGS, 0);
        if !no_zeroes {
            assert_eq!(c.read_n(124), vec![0u8; 124]);
        }
        assert_eq!(c.simple(0, CMD_WRITE, 0, 3, b"abc"), 0);
        assert_eq!(c.read(0, 3).unwrap(), b"abc");
    }
    // Unknown export with EXPORT_NAME: the server closes.
    let mut c = h.tcp();
    c.greet(FLAG_C_FIXED_NEWSTYLE);
    c.send_option(OPT_EXPORT_NAME, b"nope");
    assert!(c.at_eof());
    h.stop();
}

#[test]
fn protocol_violations_close_the_connection() {
    let h = Harness::start(ServerConfig::default());
    // Unknown client flags.
    let mut c = h.tcp();
    c.greet(1 << 5);
    assert!(c.at_eof());
    // Bad option magic.
    let mut c = h.tcp();
    c.greet(3);
    c.s.write_all(&[0u8; 16]).unwrap();
    assert!(c.at_eof());
    // Bad request magic.
    let mut c = h.tcp();
    c.connect_go("disk");
    c.s.write_all(&[0u8; 28]).unwrap();
    assert!(c.at_eof());
    // WRITE longer than 32 MiB: EINVAL, then closed; the reply arrives
    // although part of the payload was sent and is never read.
    let mut c = h.tcp();
    c.connect_go("disk");
    c.send_request(0, CMD_WRITE, 9, 0, BLOCK_SIZE_MAX + 1, &[]);
    let _ = c.s.write_all(&vec![5u8; 1 << 20]);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(c.reply(), (NBD_EINVAL, 9));
    assert!(c.at_eof());
    wait_until("connections closed", || {
        h.server.stats().connections_open == 0
    });
    h.stop();
}

#[test]
fn truncated_messages_end_the_connection_cleanly() {
    let h = Harness::start(ServerConfig::default());
    // Truncated request header, then the client closes its side.
    let mut c = h.tcp();
    c.connect_go("disk");
    c.s.write_all(&REQUEST_MAGIC.to_be_bytes()).unwrap();
    c.s.write_all(&[0u8; 6]).unwrap();
    c.s.shutdown(Shutdown::Write).unwrap();
    assert!(c.at_eof());
    // Truncated WRITE payload.
    let mut c = h.tcp();
    c.connect_go("disk");
    c.send_request(0, CMD_WRITE, 1, 0, 65536, &[1u8; 1000]);
    c.s.shutdown(Shutdown::Write).unwrap();
    assert!(c.at_eof());
    // Truncated option, then an abrupt drop mid-handshake.
    let mut c = h.tcp();
    c.greet(3);
    c.s.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
    drop(c);
    // A client vanishing with requests in flight.
    let mut c = h.tcp();
    c.connect_go("slow");
    for i in 0..8 {
        c.send_request(0, CMD_READ, i, 0, 4096, &[]);
    }
    drop(c);
    wait_until("connections closed", || {
        h.server.stats().connections_open == 0
    });
    assert_eq!(h.server.stats().inflight_bytes, 0);
    // The server still works.
    let mut c = h.tcp();
    c.connect_go("disk");
    assert_eq!(c.read(0, 16).unwrap().len(), 16);
    h.stop();
}

#[test]
fn unix_socket_go_and_io() {
    let h = Harness::start(ServerConfig::default());
    let mut c = h.unix();
    let (size, _) = c.connect_go("disk");
    assert_eq!(size, DISK_SIZE as u64);
    assert_eq!(c.simple(0, CMD_WRITE, 100, 5, b"hello"), 0);
    assert_eq!(c.read(100, 5).unwrap(), b"hello");
    // The TCP side sees the same data.
    let mut t = h.tcp();
    t.connect_go("disk");
    assert_eq!(t.read(100, 5).unwrap(), b"hello");
    h.stop();
}

#[test]
fn a_small_budget_lowers_the_largest_request_and_bounds_memory_in_flight() {
    let h = Harness::start(ServerConfig {
        workers_per_connection: 2,
        inflight_budget_bytes: 256 * 1024,
        ..ServerConfig::default()
    });
    let addr = h.addr;
    // advertised: half the budget
    const MAX: u32 = 128 * 1024;
    let mut probe = h.tcp();
    probe.greet(3);
    let (infos, fin) = probe.info_or_go(OPT_INFO, "disk", &[INFO_BLOCK_SIZE]);
    assert_eq!(fin.kind, REP_ACK);
    let bs = infos
        .iter()
        .find(|i| u16::from_be_bytes([i[0], i[1]]) == INFO_BLOCK_SIZE)
        .expect("block size sent");
    assert_eq!(u32::from_be_bytes(bs[10..14].try_into().unwrap()), MAX);
    drop(probe);
    // The in-flight bytes never pass the budget while the clients run.
    assert_eq!(h.server.stats().inflight_bytes_peak, 0);
    let threads: Vec<_> = (0..4u8)
        .map(|k| {
            std::thread::spawn(move || {
                let s = std::net::TcpStream::connect(addr).unwrap();
                let mut c = Client { s };
                c.connect_go("disk");
                let big = vec![k + 1; MAX as usize];
                let off = u64::from(k) * u64::from(MAX);
                for i in 0..4 {
                    c.send_request(0, CMD_WRITE, i, off, MAX, &big);
                }
                for _ in 0..4 {
                    assert_eq!(c.reply().0, 0);
                }
                assert_eq!(c.read(off, MAX).unwrap(), big);
                // longer than advertised: refused, its payload dropped,
                // and the connection goes on
                let longer = vec![9u8; MAX as usize + 4096];
                assert_eq!(
                    c.simple(0, CMD_WRITE, off, longer.len() as u32, &longer),
                    NBD_EINVAL
                );
                assert_eq!(c.simple(0, CMD_READ, off, MAX + 1, &[]), NBD_EINVAL);
                assert_eq!(c.read(off, MAX).unwrap(), big);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let max = h.server.stats().inflight_bytes_peak;
    assert!(
        max >= MAX.into() && max <= 256 * 1024,
        "max in flight {max}"
    );
    // a client that did not ask for the block size constraints is held
    // to them too (the budget bounds memory; proto.md lets a server
    // stricter than the 32 MiB default error such commands cleanly): the
    // longer request is refused, the connection goes on
    let mut plain = h.tcp();
    plain.greet(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES);
    let (_, fin) = plain.info_or_go(OPT_GO, "disk", &[]);
    assert_eq!(fin.kind, REP_ACK);
    let large = vec![7u8; 4 * MAX as usize];
    assert_eq!(
        plain.simple(0, CMD_WRITE, 0, large.len() as u32, &large),
        NBD_EINVAL
    );
    assert_eq!(plain.simple(0, CMD_READ, 0, MAX + 1, &[]), NBD_EINVAL);
    let fits = vec![7u8; MAX as usize];
    assert_eq!(plain.simple(0, CMD_WRITE, 0, MAX, &fits), 0);
    assert_eq!(plain.read(0, MAX).unwrap(), fits);
    // and so is one that chose its export with NBD_OPT_EXPORT_NAME
    let mut old = h.tcp();
    old.greet(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES);
    old.send_option(OPT_EXPORT_NAME, b"disk");
    old.read_n(10); // size and transmission flags
    assert_eq!(
        old.simple(0, CMD_WRITE, 0, large.len() as u32, &large),
        NBD_EINVAL
    );
    assert_eq!(old.read(0, MAX).unwrap(), fits);
    // A request's budget is given back just after its reply is sent.
    wait_until("budget returned", || h.server.stats().inflight_bytes == 0);
    assert!(h.server.stats().connections_total >= 4);
    h.stop();
}

#[test]
fn shutdown_finishes_inflight_requests_then_returns() {
    let h = Harness::start(ServerConfig::default());
    let mut idle = h.unix();
    idle.connect_go("disk");
    let mut negotiating = h.tcp();
    negotiating.greet(3);
    let mut oversized = h.tcp();
    oversized.greet(3);
    let mut busy = h.tcp();
    busy.connect_go("slow");
    busy.send_request(0, CMD_READ, 42, 0, 4096, &[]);
    // (the server has taken the read: it is in flight, not waiting in
    // the socket, where a shutdown would refuse it)
    wait_until("read taken", || h.server.stats().requests_total >= 1);
    let started = Instant::now();
    h.shutdown.shutdown();
    // A client negotiating an option with more data than an option may
    // carry is answered NBD_REP_ERR_SHUTDOWN at once, its data left
    // unread, and closed.
    oversized.send_option_header(OPT_LIST, 1 << 30);
    let r = oversized.option_reply();
    assert_eq!((r.option, r.kind), (OPT_LIST, proto::REP_ERR_SHUTDOWN));
    assert!(oversized.at_eof());
    // A client still negotiating has its options refused with
    // ERR_SHUTDOWN (proto.md: the server SHOULD), then is closed.
    negotiating.send_option(OPT_LIST, &[]);
    let r = negotiating.option_reply();
    assert_eq!((r.option, r.kind), (OPT_LIST, proto::REP_ERR_SHUTDOWN));
    assert!(negotiating.at_eof());
    // The in-flight read is still answered.
    assert_eq!(busy.reply(), (0, 42));
    assert_eq!(busy.read_n(4096).len(), 4096);
    assert!(busy.at_eof());
    assert!(idle.at_eof());

    let addr = h.addr;
    h.stop();
    assert!(started.elapsed() < Duration::from_secs(5));
    // The listener is gone: nothing accepts any more.
    assert!(std::net::TcpStream::connect(addr).is_err());
}

/// Sends `n` pipelined 4 KiB writes and a flush in one go, then reads the
/// replies; every reply must arrive within 2 s of the previous one (none
/// may stay queued behind `MSG_MORE`).
fn pipelined_writes_then_flush<S: std::io::Read + Write>(mut c: Client<S>, n: u64, round: u64) {
    let limit = Duration::from_secs(2);
    let mut requests = Vec::new();
    for i in 0..n {
        requests.push(request_bytes(
            0,
            CMD_WRITE,
            i,
            i * 4096,
            4096,
            &vec![(i + round) as u8; 4096],
        ));
    }
    requests.push(request_bytes(0, CMD_FLUSH, u64::MAX, 0, 0, &[]));
    c.s.write_all(&requests.concat()).unwrap();
    let mut seen = std::collections::HashSet::new();
    let mut last = Instant::now();
    for _ in 0..=n {
        let (err, handle) = c.reply();
        let waited = last.elapsed();
        assert!(
            waited <= limit,
            "round {round}: a reply took {waited:?} (after {} replies)",
            seen.len()
        );
        last = Instant::now();
        assert_eq!(err, 0);
        assert!(seen.insert(handle), "duplicate reply {handle}");
    }
    assert!(seen.contains(&u64::MAX), "flush answered");
}

#[test]
fn pipelined_writes_and_flush_are_all_answered_promptly() {
    let h = Harness::start(ServerConfig::default());
    for round in 0..20 {
        let mut c = h.tcp();
        c.s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        c.connect_go("disk");
        pipelined_writes_then_flush(c, 64, round);
        let mut u = h.unix();
        u.s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        u.connect_go("disk");
        pipelined_writes_then_flush(u, 64, round);
    }
    // One worker per connection: every reply has nothing in flight beside it.
    let h1 = Harness::start(ServerConfig {
        workers_per_connection: 1,
        ..ServerConfig::default()
    });
    let mut c = h1.tcp();
    c.s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    c.connect_go("disk");
    pipelined_writes_then_flush(c, 64, 0);
    h1.stop();
    h.stop();
}

#[test]
fn fast_reply_is_not_held_behind_a_slow_request() {
    // A 3 s read is in flight while a flush completes: the flush reply is
    // sent with MSG_MORE (another request is in flight), and must still be
    // pushed to the client long before the read finishes.
    let h = Harness::start(ServerConfig::default());
    let mut c = h.tcp();
    c.connect_go("stall");
    let start = Instant::now();
    c.send_request(0, CMD_READ, 1, 0, 512, &[]);
    c.send_request(0, CMD_FLUSH, 2, 0, 0, &[]);
    // The flush goes to the "stall" export too, and sleeps 0 s (only I/O
    // sleeps), so its reply is ready at once.
    assert_eq!(c.reply(), (0, 2));
    let waited = start.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "flush reply took {waited:?}"
    );
    assert_eq!(c.reply(), (0, 1));
    c.read_n(512);
    h.stop();
}

#[test]
fn a_reply_is_not_held_behind_a_slow_flush_or_fua_write() {
    // A FUA write takes 3 s; a FLUSH completes at once while the reader
    // is busy reading a payload the client sends slowly (not waiting for
    // the client): the FLUSH reply must go out at once, not wait as if
    // the slow write's reply would soon follow it.
    reply_not_held_behind_a_slow_write(CMD_FLAG_FUA);
}

#[test]
fn a_reply_is_not_held_behind_a_write_that_may_wait_for_the_disk() {
    // the same with a plain write the export says may wait for the disk
    // (a store committing from its write path)
    reply_not_held_behind_a_slow_write(0);
}

/// Sends a 3 s write with `flags` to the "stall" export, a FLUSH, and a
/// WRITE whose payload comes later; the FLUSH's reply must not wait.
/// Held with `MSG_MORE`, a reply leaves only after the kernel's 200 ms:
/// four connections do this at once, and the fastest reply must come
/// well before that (a loaded machine may delay some, or a whole round:
/// up to three rounds are tried; a held reply fails every one).
fn reply_not_held_behind_a_slow_write(flags: u16) {
    let h = Harness::start(ServerConfig::default());
    let mut rounds_waited = Vec::new();
    for _ in 0..3 {
        let waits = four_connections_flush_behind_a_slow_write(&h, flags);
        let fastest = *waits.iter().min().unwrap();
        rounds_waited.push(waits);
        if fastest < Duration::from_millis(150) {
            break;
        }
    }
    let fastest = rounds_waited.last().unwrap().iter().min().unwrap();
    assert!(
        *fastest < Duration::from_millis(150),
        "flush replies took {rounds_waited:?}"
    );
    h.stop();
}

/// One round of [`reply_not_held_behind_a_slow_write`]: each of four
/// connections' wait for its FLUSH reply.
fn four_connections_flush_behind_a_slow_write(h: &Harness, flags: u16) -> Vec<Duration> {
    std::thread::scope(|scope| {
        let rounds: Vec<_> = (0..4)
            .map(|_| {
                let mut c = h.tcp();
                scope.spawn(move || {
                    c.connect_go("stall");
                    // (all in one send: the reader never waits for the
                    // client between them)
                    let mut all = request_bytes(flags, CMD_WRITE, 1, 0, 4, b"slow");
                    all.extend(request_bytes(0, CMD_FLUSH, 2, 0, 0, &[]));
                    all.extend(request_bytes(0, CMD_WRITE, 3, 4096, 8, b"half"));
                    let start = Instant::now();
                    c.s.write_all(&all).unwrap();
                    assert_eq!(c.reply(), (0, 2));
                    let waited = start.elapsed();
                    c.s.write_all(b"more").unwrap();
                    let mut got = [c.reply(), c.reply()];
                    got.sort_by_key(|r| r.1);
                    assert_eq!(got, [(0, 1), (0, 3)]);
                    waited
                })
            })
            .collect();
        rounds.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

#[test]
fn stalled_write_payload_releases_the_budget() {
    // Two WRITE headers whose payloads never come hold the whole budget;
    // without a bound every other client would wait for ever.
    let h = Harness::start(ServerConfig {
        inflight_budget_bytes: 1 << 20,
        payload_timeout: Duration::from_millis(700),
        ..ServerConfig::default()
    });
    let mut stalled: Vec<_> = (0..2)
        .map(|_| {
            let mut c = h.tcp();
            c.connect_go("disk");
            // (the largest request: half the budget)
            c.send_request(0, CMD_WRITE, 1, 0, 1 << 19, &[1u8; 100]);
            c
        })
        .collect();
    wait_until("budget taken", || {
        h.server.stats().inflight_bytes >= 1 << 20
    });
    let started = Instant::now();
    let mut c = h.tcp();
    c.connect_go("disk");
    assert_eq!(c.simple(0, CMD_WRITE, 0, 4, b"live"), 0);
    assert_eq!(c.read(0, 4).unwrap(), b"live");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    for s in &mut stalled {
        assert!(s.at_eof(), "a stalled WRITE ends its connection");
    }
    wait_until("budget returned", || h.server.stats().inflight_bytes == 0);
    h.stop();
}

#[test]
fn a_large_payload_may_take_longer_than_the_payload_timeout() {
    // 2 MiB sent at about 1.3 MiB/s: 1.5 s, past the 0.7 s timeout but
    // within its 1 s per MiB of payload
    let h = Harness::start(ServerConfig {
        payload_timeout: Duration::from_millis(700),
        ..ServerConfig::default()
    });
    let mut c = h.tcp();
    c.connect_go("disk");
    let payload: Vec<u8> = (0..2u32 << 20).map(|i| (i % 251) as u8).collect();
    c.send_request(0, CMD_WRITE, 7, 0, payload.len() as u32, &[]);
    for piece in payload.chunks(512 << 10) {
        std::thread::sleep(Duration::from_millis(375));
        c.s.write_all(piece).unwrap();
    }
    assert_eq!(c.reply(), (0, 7));
    assert!(c.read(0, 2 << 20).unwrap() == payload);
    h.stop();
}

#[test]
fn a_refused_write_whose_payload_stalls_ends_its_connection() {
    // A WRITE past the end is refused, but its payload must still be read
    // to keep the stream in step; one that never comes may not hold the
    // connection (and its reading thread) for ever.
    let h = Harness::start(ServerConfig {
        payload_timeout: Duration::from_millis(700),
        ..ServerConfig::default()
    });
    let mut c = h.tcp();
    let (size, _) = c.connect_go("disk");
    c.send_request(0, CMD_WRITE, 1, size, 1 << 20, &[1u8; 100]);
    let started = Instant::now();
    assert!(c.at_eof(), "the stalled refused WRITE ends its connection");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // A refused WRITE whose payload does arrive is answered, and the
    // connection goes on.
    let mut d = h.tcp();
    d.connect_go("disk");
    d.send_request(0, CMD_WRITE, 2, size, 8, b"12345678");
    assert_eq!(d.reply(), (NBD_ENOSPC, 2));
    assert_eq!(d.simple(0, CMD_WRITE, 0, 2, b"ok"), 0);
    h.stop();
}

#[test]
fn connections_are_capped_and_silent_negotiations_dropped() {
    let h = Harness::start(ServerConfig {
        max_connections: 2,
        handshake_timeout: Duration::from_secs(2),
        ..ServerConfig::default()
    });
    let mut a = h.tcp();
    a.connect_go("disk");
    let mut b = h.unix();
    b.connect_go("disk");
    // A third is closed at once, without a greeting.
    let mut c = h.tcp();
    assert!(c.at_eof());
    wait_until("refusal counted", || {
        h.server.stats().connections_refused == 1
    });
    assert_eq!(h.server.stats().connections_open, 2);
    assert_eq!(
        h.server.stats().read_buffer_bytes,
        2 * dedupd_nbd::READ_BUFFER_BYTES as u64
    );
    // Both finished negotiating (the server stops counting a connection
    // as negotiating just after its final reply, which the client may
    // have read first).
    wait_until("both finished negotiating", || {
        h.server.stats().connections_negotiating == 0
    });
    assert_eq!(h.server.stats().negotiation_buffer_bytes, 0);
    // The open ones still work; closing one makes room.
    assert_eq!(a.simple(0, CMD_WRITE, 0, 2, b"ok"), 0);
    drop(b);
    wait_until("one closed", || h.server.stats().connections_open == 1);
    // A client that greets and then says nothing is dropped after the
    // handshake timeout; one idle in transmission (`a`) is kept.
    let mut silent = h.tcp();
    silent.greet(proto::FLAG_C_FIXED_NEWSTYLE);
    let started = Instant::now();
    let stats = h.server.stats();
    assert_eq!(stats.connections_negotiating, 1);
    assert_eq!(
        stats.negotiation_buffer_bytes,
        dedupd_nbd::NEGOTIATION_BUFFER_BYTES as u64
    );
    assert!(silent.at_eof());
    wait_until("negotiation ended", || {
        h.server.stats().connections_negotiating == 0
    });
    assert!(started.elapsed() < Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(a.read(0, 2).unwrap(), b"ok");
    h.stop();
}

#[test]
fn a_client_that_does_not_read_its_option_replies_is_dropped_at_the_negotiation_deadline() {
    let h = Harness::start(ServerConfig {
        handshake_timeout: Duration::from_millis(800),
        ..ServerConfig::default()
    });
    let mut c = h.tcp();
    c.greet(proto::FLAG_C_FIXED_NEWSTYLE);
    // LIST after LIST, replies never read: the server's sends block once
    // the socket buffers fill (some 20 MB of replies, more than loopback's
    // buffers hold; the read deadline is not checked while a send blocks)
    let mut list = proto::IHAVEOPT.to_be_bytes().to_vec();
    list.extend_from_slice(&proto::OPT_LIST.to_be_bytes());
    list.extend_from_slice(&0u32.to_be_bytes());
    let options: Vec<u8> = list.repeat(200_000);
    let mut s = c.s.try_clone().unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    let sender = std::thread::spawn(move || {
        // (fails once the server closes the connection)
        let _ = s.write_all(&options);
    });
    wait_until("negotiating", || h.server.stats().connections_open == 1);
    let started = Instant::now();
    wait_until("dropped", || h.server.stats().connections_open == 0);
    // the deadline, not the 60 s a stalled send is otherwise given
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    drop(c);
    sender.join().unwrap();
    h.stop();
}

#[test]
fn requests_sent_before_shutdown_get_eshutdown_but_flush_flushes() {
    let h = Harness::start(ServerConfig {
        workers_per_connection: 1,
        ..ServerConfig::default()
    });
    let mut c = h.tcp();
    c.connect_go("stall");
    // The one worker executes the first (3 s) read; the rest wait in the
    // socket, the third a WRITE whose payload must be skipped.
    c.send_request(0, CMD_READ, 1, 0, 512, &[]);
    c.send_request(0, CMD_READ, 2, 0, 512, &[]);
    c.send_request(0, CMD_WRITE, 3, 0, 4, b"abcd");
    c.send_request(0, CMD_FLUSH, 4, 0, 0, &[]);
    let flushes_before = *h.provider.stall.flushes.lock().unwrap();
    wait_until("first read taken", || h.server.stats().requests_total == 1);
    h.shutdown.shutdown();
    assert_eq!(c.reply(), (0, 1));
    assert_eq!(c.read_n(512).len(), 512);
    for handle in 2..=3 {
        assert_eq!(c.reply(), (NBD_ESHUTDOWN, handle));
    }
    // a FLUSH still flushes: the writes it covers were acknowledged
    assert_eq!(c.reply(), (0, 4));
    assert!(c.at_eof());
    assert_eq!(
        *h.provider.stall.flushes.lock().unwrap(),
        flushes_before + 1
    );
    h.stop();
}

#[test]
fn idle_connections_keep_no_request_buffers() {
    let config = ServerConfig::default();
    let workers = config.workers_per_connection as u64;
    let h = Harness::start(config);
    let mut clients: Vec<Client<std::net::TcpStream>> = (0..3)
        .map(|_| {
            let mut c = h.tcp();
            c.connect_go("disk");
            c
        })
        .collect();
    for c in &mut clients {
        for i in 0..4u64 {
            c.send_request(0, CMD_READ, i, i << 20, 1 << 20, &[]);
        }
        for _ in 0..4 {
            assert_eq!(c.reply().0, 0);
            assert_eq!(c.read_n(1 << 20).len(), 1 << 20);
        }
    }
    let kept = h.server.stats().kept_buffer_bytes;
    // (a READ's buffer holds its reply header too, rounded up to 4 KiB)
    assert!(
        kept <= 3 * workers * ((1 << 20) + 4096),
        "{kept} bytes kept"
    );
    // every connection now waits for its client: none keeps a buffer
    wait_until("idle connections to free their buffers", || {
        h.server.stats().kept_buffer_bytes == 0
    });
    for c in &mut clients {
        assert_eq!(c.read(0, 2).unwrap().len(), 2);
    }
    h.stop();
}

#[test]
fn a_client_that_keeps_negotiating_is_dropped_at_the_deadline() {
    let h = Harness::start(ServerConfig {
        handshake_timeout: Duration::from_millis(1500),
        ..ServerConfig::default()
    });
    // (before the connection: the server's deadline starts after it)
    let started = Instant::now();
    let mut c = h.tcp();
    c.greet(proto::FLAG_C_FIXED_NEWSTYLE);
    // each option is answered, well within the per-read time, but the
    // negotiation as a whole never ends
    let mut answered = 0;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let mut header = proto::IHAVEOPT.to_be_bytes().to_vec();
        header.extend_from_slice(&OPT_LIST.to_be_bytes());
        header.extend_from_slice(&0u32.to_be_bytes());
        if c.s.write_all(&header).is_err() || !list_answered(&mut c.s) {
            break;
        }
        answered += 1;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "still negotiating after {answered} options"
        );
    }
    assert!(answered >= 2, "only {answered} options answered");
    assert!(started.elapsed() >= Duration::from_millis(1500));
    wait_until("the connection to close", || {
        h.server.stats().connections_open == 0
    });
    h.stop();
}

/// Reads the replies to NBD_OPT_LIST up to its ACK; false if the
/// connection ends first.
fn list_answered(s: &mut impl std::io::Read) -> bool {
    loop {
        let mut h = [0u8; 20];
        if s.read_exact(&mut h).is_err() {
            return false;
        }
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        if s.read_exact(&mut data).is_err() {
            return false;
        }
        if kind == REP_ACK {
            return true;
        }
    }
}

#[test]
fn tcp_connections_are_kept_alive() {
    let h = Harness::start(ServerConfig::default());
    let mut c = h.tcp();
    c.connect_go("disk");
    let server_port = c.s.peer_addr().unwrap().port();
    let client_port = c.s.local_addr().unwrap().port();
    // the server's end of the connection, in /proc/net/tcp: its timer
    // field ("tr") is 2 while a keepalive timer runs
    let port = |field: &str| u16::from_str_radix(field.rsplit(':').next().unwrap(), 16).unwrap();
    // (the retransmit timer, 01, runs instead until the client's ACK of
    // the last reply arrives)
    let timer = || {
        let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let line = tcp
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            .find(|f| port(&f[1]) == server_port && port(&f[2]) == client_port)
            .expect("the server's socket in /proc/net/tcp");
        line[5].split(':').next().unwrap().to_string()
    };
    wait_until("a keepalive timer on the server's socket", || {
        timer() == "02"
    });
    assert_eq!(c.read(0, 2).unwrap().len(), 2);
    h.stop();
}

#[test]
fn shutdown_reads_what_clients_send_after_the_servers_fin() {
    let h = Harness::start(ServerConfig::default());
    let mut c = h.tcp();
    c.connect_go("disk");
    assert_eq!(c.simple(0, CMD_WRITE, 0, 2, b"ok"), 0);
    let shutdown = h.server.shutdown_handle();
    shutdown.shutdown();
    // the server ends the idle connection with FIN
    assert!(c.at_eof());
    // the client says goodbye as the spec asks after a shutdown: the
    // server reads and drops it instead of answering with a reset
    c.send_request(0, CMD_DISC, 9, 0, 0, &[]);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        c.s.take_error().unwrap().is_none(),
        "the server reset the connection"
    );
    c.s.shutdown(Shutdown::Write).unwrap();
    h.stop();
}

#[test]
fn one_connection_cannot_take_the_whole_inflight_budget() {
    // 1 MiB budget; four reads of 262 000 bytes would take all but 512
    // bytes of it, too little for another client's 4 KiB read
    let h = Harness::start(ServerConfig {
        inflight_budget_bytes: 1 << 20,
        ..ServerConfig::default()
    });
    let mut a = h.unix();
    a.connect_go("disk");
    // a client that sends reads and does not read the replies: they stay
    // in flight, holding their budget, while the server's sends block
    for i in 0..4u64 {
        a.send_request(0, CMD_READ, i, 0, 262_000, &[]);
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut b = h.tcp();
    b.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    b.connect_go("disk");
    let started = Instant::now();
    assert_eq!(b.read(0, 4096).unwrap().len(), 4096);
    assert!(started.elapsed() < Duration::from_secs(3));
    drop(a);
    h.stop();
}

#[test]
fn a_negotiating_client_that_does_not_read_cannot_hold_up_shutdown() {
    // Options sent in bulk by a client that never reads the answers: the
    // server's reply blocks on a full socket. A shutdown must still end
    // the connection within its negotiation grace, not after a send
    // timeout.
    let h = Harness::start(ServerConfig::default());
    let mut c = h.tcp();
    c.greet(proto::FLAG_C_FIXED_NEWSTYLE);
    let mut writer = c.s.try_clone().unwrap();
    let flood = std::thread::spawn(move || {
        let mut header = proto::IHAVEOPT.to_be_bytes().to_vec();
        header.extend_from_slice(&OPT_LIST.to_be_bytes());
        header.extend_from_slice(&0u32.to_be_bytes());
        let batch: Vec<u8> = header.repeat(4096);
        // until the server stops reading, or closes
        for _ in 0..2048 {
            if writer.write_all(&batch).is_err() {
                break;
            }
        }
    });
    wait_until("the server's replies to fill the socket", || {
        let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let port = c.s.local_addr().unwrap().port();
        // the client's receive queue (rx_queue), in hex, on its own socket
        tcp.lines().skip(1).any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local = u16::from_str_radix(f[1].rsplit(':').next().unwrap(), 16).unwrap();
            let rx = u64::from_str_radix(f[4].split(':').nth(1).unwrap(), 16).unwrap();
            local == port && rx > 16 << 10
        })
    });
    // (until both sockets' buffers are full and the server's send blocks)
    std::thread::sleep(Duration::from_millis(1500));
    let started = Instant::now();
    h.stop();
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "shutdown took {:?}",
        started.elapsed()
    );
    drop(c);
    flood.join().unwrap();
}
