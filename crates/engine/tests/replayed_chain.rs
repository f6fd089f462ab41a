//! The journal chain replayed at open is written again before anything
//! is acknowledged durable: it was read through the page cache, and if an
//! earlier process's sync of it failed (the kernel then marks the pages
//! clean, keeping their new bytes) it may not be on disk, which no sync of
//! this process would change.

use std::sync::{Arc, Mutex};

use dedupd_engine::observe::{IoEvent, IoObserver, Observer};
use dedupd_engine::{Engine, EngineConfig, HashAlgorithm};

#[derive(Debug, Clone, PartialEq)]
enum Ev {
    Write(u64, Vec<u8>),
    Sync,
    /// A write to the data file, at this byte offset.
    DataWrite(u64),
}

/// The journal's writes and syncs, and (only with `data`) the data
/// file's writes.
#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<Ev>>,
    data: bool,
}

impl IoObserver for Recorder {
    fn event(&self, e: IoEvent<'_>) {
        let ev = match e {
            IoEvent::Write {
                file: "journal",
                offset,
                data,
            } => Ev::Write(offset, data.to_vec()),
            IoEvent::Sync { file: "journal" } => Ev::Sync,
            IoEvent::Write {
                file: "data",
                offset,
                ..
            } if self.data => Ev::DataWrite(offset),
            _ => return,
        };
        self.events.lock().unwrap().push(ev);
    }
}

impl Recorder {
    fn take(&self) -> Vec<Ev> {
        std::mem::take(&mut self.events.lock().unwrap())
    }
}

fn block(k: u8) -> Vec<u8> {
    vec![k; 4096]
}

/// The journal's bytes now, up to its write offset as the chain ends.
fn journal(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path.join("journal")).unwrap()
}

#[test]
fn the_replayed_chain_is_written_again_before_a_flush_is_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let v = e.create_volume("v", 1 << 20).unwrap();
    e.write(v, 0, &block(1), false).unwrap();
    e.write(v, 4096, &block(2), true).unwrap();
    // a crash: the commits stay in the journal, to be replayed
    e.drop_without_closing();
    let on_disk = journal(&path);
    assert!(on_disk.iter().any(|&b| b != 0), "nothing journaled");

    let recorder = Arc::new(Recorder::default());
    let config = EngineConfig {
        observer: Observer(Some(recorder.clone())),
        ..EngineConfig::default()
    };
    let e = Engine::open(&path, config.clone()).unwrap();
    assert!(recorder.take().is_empty(), "opening wrote the journal");
    // a FLUSH with nothing new: the chain is written again, byte for byte
    // from the start, and synced before it returns
    e.flush().unwrap();
    let evs = recorder.take();
    assert_eq!(evs.last(), Some(&Ev::Sync), "{evs:?}");
    let mut end = 0;
    for ev in &evs[..evs.len() - 1] {
        let Ev::Write(at, data) = ev else {
            panic!("{evs:?}")
        };
        assert_eq!(*at, end);
        assert_eq!(&on_disk[*at as usize..*at as usize + data.len()], &data[..]);
        end += data.len() as u64;
    }
    assert!(end > 0, "the chain was not written again: {evs:?}");
    // once only
    e.flush().unwrap();
    assert!(recorder.take().is_empty());
    let mut buf = vec![0u8; 8192];
    e.read(v, 0, &mut buf).unwrap();
    assert!(buf[..4096] == block(1)[..] && buf[4096..] == block(2)[..]);
    e.drop_without_closing();

    // a commit after a restart writes the chain again before its own
    // transaction, which follows it
    let chain = journal(&path);
    let e = Engine::open(&path, config).unwrap();
    e.write(v, 8192, &block(3), true).unwrap();
    let evs = recorder.take();
    let writes: Vec<(u64, usize)> = evs
        .iter()
        .filter_map(|ev| match ev {
            Ev::Write(at, d) => Some((*at, d.len())),
            _ => None,
        })
        .collect();
    assert_eq!(writes.first().map(|w| w.0), Some(0), "{writes:?}");
    let first_sync = evs.iter().position(|ev| *ev == Ev::Sync).unwrap();
    let head_end: u64 = evs[..first_sync]
        .iter()
        .map(|ev| match ev {
            Ev::Write(_, d) => d.len() as u64,
            _ => 0,
        })
        .sum();
    assert!(head_end > 0 && head_end <= chain.len() as u64);
    assert!(
        evs[first_sync + 1..]
            .iter()
            .any(|ev| matches!(ev, Ev::Write(at, _) if *at == head_end)),
        "the new transaction does not follow the chain: {writes:?}"
    );
    e.close().unwrap();
    drop(e);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(v, 8192, &mut buf).unwrap();
    assert_eq!(buf, block(3));
}

#[test]
fn a_replayed_transaction_that_reads_back_changed_is_written_again_as_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let v = e.create_volume("v", 1 << 20).unwrap();
    e.write(v, 0, &block(1), true).unwrap();
    e.drop_without_closing();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    // the bytes replayed are gone from the page cache and the disk holds
    // others (a sync of them failed before): one changed here
    let journal_path = path.join("journal");
    let replayed = std::fs::read(&journal_path).unwrap();
    let mut bytes = replayed.clone();
    bytes[40] ^= 0xff;
    std::fs::write(&journal_path, &bytes).unwrap();
    // what was replayed, held in memory, is written again over them
    e.flush().unwrap();
    let now = std::fs::read(&journal_path).unwrap();
    assert_eq!(now[40], replayed[40], "the changed byte was kept");
    e.write(v, 4096, &block(2), true).unwrap();
    e.drop_without_closing();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let mut buf = vec![0u8; 8192];
    e.read(v, 0, &mut buf).unwrap();
    assert!(buf[..4096] == block(1)[..], "the replayed write was lost");
    assert!(buf[4096..] == block(2)[..], "the write after it was lost");
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn no_block_the_replayed_chain_released_is_reused_before_the_chain_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let v = e.create_volume("v", 1 << 20).unwrap();
    e.write(v, 0, &block(1), true).unwrap();
    // the overwrite releases block 1's PBA in a commit that stays in the
    // journal (a crash), and is replayed at the next open
    e.write(v, 0, &block(2), true).unwrap();
    e.drop_without_closing();

    let recorder = Arc::new(Recorder {
        data: true,
        ..Recorder::default()
    });
    let config = EngineConfig {
        observer: Observer(Some(recorder.clone())),
        ..EngineConfig::default()
    };
    let e = Engine::open(&path, config).unwrap();
    assert!(recorder.take().is_empty(), "opening wrote");
    // a write with no FLUSH: it takes the lowest free PBA, the one the
    // replayed chain released; the chain must be on disk (written again
    // and synced) before the new data goes there
    e.write(v, 4096, &block(3), false).unwrap();
    let evs = recorder.take();
    let first_data = evs
        .iter()
        .position(|ev| matches!(ev, Ev::DataWrite(0)))
        .unwrap_or_else(|| panic!("PBA 0 was not reused: {evs:?}"));
    assert!(
        evs[..first_data].contains(&Ev::Sync),
        "data written over a released block before the chain was durable: {evs:?}"
    );
    e.flush().unwrap();
    let mut buf = vec![0u8; 8192];
    e.read(v, 0, &mut buf).unwrap();
    assert!(buf[..4096] == block(2)[..] && buf[4096..] == block(3)[..]);
    assert!(e.check().is_empty(), "{:?}", e.check());
}
