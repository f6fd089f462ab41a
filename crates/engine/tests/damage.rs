//! Damage detection and repair: one flipped bit in each kind of metadata
//! file, a torn last journal record, and `fsck` finding and fixing each.

use std::path::{Path, PathBuf};

use dedupd_engine::fsck::{fsck, FsckOptions};
use dedupd_engine::{Engine, EngineConfig, EngineError, HashAlgorithm};

fn pattern(i: u64) -> Vec<u8> {
    let mut b: Vec<u8> = (0..4096u64)
        .map(|b| ((b * 7 + i * 13) % 251) as u8 + 1)
        .collect();
    b[..8].copy_from_slice(&i.to_le_bytes());
    b
}

/// A closed store with two volumes sharing content: `a` holds patterns
/// 0..600 (two map pages), `b` holds patterns 0..100.
fn build(dir: &Path) -> PathBuf {
    let path = dir.join("store");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let a = e.create_volume("a", 8 << 20).unwrap();
    let b = e.create_volume("b", 8 << 20).unwrap();
    let data: Vec<u8> = (0..600).flat_map(pattern).collect();
    e.write(a, 0, &data, false).unwrap();
    e.write(b, 0, &data[..100 * 4096], false).unwrap();
    e.close().unwrap();
    path
}

/// `fsck --repair` of the store at `path`.
fn fsck_repair(path: &Path) -> dedupd_engine::fsck::FsckReport {
    fsck(
        path,
        FsckOptions {
            repair: true,
            rehash: false,
        },
    )
    .unwrap()
}

/// `fsck --repair --rehash` of the store at `path`.
fn fsck_rehash_repair(path: &Path) -> dedupd_engine::fsck::FsckReport {
    fsck(
        path,
        FsckOptions {
            repair: true,
            rehash: true,
        },
    )
    .unwrap()
}

/// The map file of the volume created first (volume `a` of [`build`]).
fn first_map_file(store: &Path) -> PathBuf {
    std::fs::read_dir(store.join("maps"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .min()
        .unwrap()
}

fn flip(file: &Path, offset: u64) {
    let mut bytes = std::fs::read(file).unwrap();
    bytes[offset as usize] ^= 0x20;
    std::fs::write(file, bytes).unwrap();
}

fn assert_intact(path: &Path, volumes: &[(&str, u64)]) {
    let e = Engine::open(path, EngineConfig::default()).unwrap();
    for (name, blocks) in volumes {
        let (id, _) = e.volume(name).unwrap();
        for i in 0..*blocks {
            let mut buf = vec![0u8; 4096];
            e.read(id, i * 4096, &mut buf).unwrap();
            assert!(buf == pattern(i), "volume {name} block {i} differs");
        }
    }
    assert!(e.check().is_empty(), "{:?}", e.check());
}

fn repair(path: &Path) -> i32 {
    let check = fsck(path, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4, "damage not found: {check:?}");
    let fixed = fsck_repair(path);
    let code = fixed.exit_code();
    assert_eq!(
        fsck(
            path,
            FsckOptions {
                repair: false,
                rehash: true
            }
        )
        .unwrap()
        .exit_code(),
        0
    );
    code
}

#[test]
fn clean_store_is_clean() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let r = fsck(
        &path,
        FsckOptions {
            repair: false,
            rehash: true,
        },
    )
    .unwrap();
    assert_eq!(r.exit_code(), 0, "{r:?}");
    assert_eq!(r.referenced_blocks, 600);
    assert_eq!(r.mapped_blocks, 700);
    assert_eq!(r.blocks_rehashed, 600);
}

#[test]
fn flipped_reference_count_page_stops_the_store_and_fsck_rebuilds_it() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    flip(&path.join("refcounts"), 10);
    match Engine::open(&path, EngineConfig::default()) {
        Err(EngineError::Corrupt { file, detail }) => {
            assert!(file.ends_with("refcounts"));
            assert!(detail.contains("fsck --repair"), "{detail}");
            assert!(!detail.contains("  "), "{detail}");
        }
        other => panic!("opened a damaged store: {:?}", other.err()),
    }
    assert_eq!(repair(&path), 1);
    assert_intact(&path, &[("a", 600), ("b", 100)]);
}

#[test]
fn missing_metadata_files_are_damage_not_an_empty_store() {
    // the reference counts or the reverse index gone: the store is not
    // served; fsck says so without creating anything, and a repair
    // rebuilds them from the maps and the data
    for name in ["refcounts", "fingerprints"] {
        let d = tempfile::tempdir().unwrap();
        let path = build(d.path());
        std::fs::remove_file(path.join(name)).unwrap();
        match Engine::open(&path, EngineConfig::default()) {
            Err(EngineError::Corrupt { file, detail }) => {
                assert!(file.ends_with(name));
                assert!(detail.contains("missing"), "{detail}");
            }
            other => panic!("opened without {name}: {:?}", other.err()),
        }
        let check = fsck(&path, FsckOptions::default()).unwrap();
        assert_eq!(check.exit_code(), 4, "{check:?}");
        assert!(
            check.problems.iter().any(|p| p.contains("is missing")),
            "{check:?}"
        );
        assert!(!path.join(name).exists(), "a check created {name}");
        assert_eq!(repair(&path), 1);
        assert_intact(&path, &[("a", 600), ("b", 100)]);
    }
    // the same with commits still in the journal (a crash image): pages
    // of the file in the journal over an empty file would read every
    // other block as free
    for name in ["refcounts", "fingerprints"] {
        let d = tempfile::tempdir().unwrap();
        let crash = crash_image_with_a_commit(d.path());
        std::fs::remove_file(crash.join(name)).unwrap();
        match Engine::open(&crash, EngineConfig::default()) {
            Err(EngineError::Corrupt { file, .. }) => assert!(file.ends_with(name)),
            other => panic!("opened without {name}: {:?}", other.err()),
        }
        assert_eq!(repair(&crash), 1);
        assert_intact(&crash, &[("a", 600), ("b", 100)]);
        let e = Engine::open(&crash, EngineConfig::default()).unwrap();
        let mut buf = vec![0u8; 4096];
        e.read(e.volume("b").unwrap().0, 300 * 4096, &mut buf)
            .unwrap();
        assert!(buf == pattern(1), "{name}: the journal's write was lost");
    }
    // and with nothing left to count (every volume deleted; the data file
    // keeps its length): a repair still creates the file again
    for name in ["refcounts", "fingerprints"] {
        let d = tempfile::tempdir().unwrap();
        let path = build(d.path());
        let e = Engine::open(&path, EngineConfig::default()).unwrap();
        e.delete_volume("a").unwrap();
        e.delete_volume("b").unwrap();
        e.close().unwrap();
        drop(e);
        std::fs::remove_file(path.join(name)).unwrap();
        assert!(Engine::open(&path, EngineConfig::default()).is_err());
        assert_eq!(repair(&path), 1);
        assert!(path.join(name).exists(), "{name} was not created again");
        let e = Engine::open(&path, EngineConfig::default()).unwrap();
        assert!(e.check().is_empty(), "{:?}", e.check());
    }
    // a volume map gone: its volume is served read-only and fsck reports
    // the loss instead of calling the store clean
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let map = first_map_file(&path);
    std::fs::remove_file(&map).unwrap();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (a, _) = e.volume("a").unwrap();
    assert!(e.volume_read_only(a));
    assert!(matches!(
        e.write(a, 0, &pattern(1), false),
        Err(EngineError::ReadOnly { .. })
    ));
    let mut buf = vec![0u8; 4096];
    assert!(matches!(
        e.read(a, 0, &mut buf),
        Err(EngineError::MappingLost { lba: 0, .. })
    ));
    drop(e);
    let check = fsck(&path, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4, "{check:?}");
    assert!(
        check
            .data_lost
            .iter()
            .any(|l| l.contains("map file is missing")),
        "{check:?}"
    );
    assert!(!map.exists(), "a check created the map file");
    // a repair keeps what volume b still maps, and makes a writable again
    assert_eq!(repair(&path), 1);
    assert_intact(&path, &[("b", 100)]);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (a, _) = e.volume("a").unwrap();
    e.write(a, 0, &pattern(1), true).unwrap();
    assert!(map.exists());

    // a map gone while the journal still changes it, its length too (a
    // resize since the last checkpoint; a crash image): its other LBAs
    // must not read as holes, nor the journal recreate it
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (b, _) = e.volume("b").unwrap();
    // (a second map page, in place before the journal's changes)
    e.write(b, 1000 * 4096, &pattern(5), true).unwrap();
    e.checkpoint().unwrap();
    e.resize_volume("b", 16 << 20).unwrap();
    e.write(b, 300 * 4096, &pattern(1), true).unwrap();
    let crash = d.path().join("crash");
    crash_copy(&path, &crash);
    drop(e);
    let maps: Vec<PathBuf> = {
        let mut v: Vec<PathBuf> = std::fs::read_dir(crash.join("maps"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        v.sort();
        v
    };
    let map_b = maps[1].clone();
    std::fs::remove_file(&map_b).unwrap();
    let e = Engine::open(&crash, EngineConfig::default()).unwrap();
    let (b, _) = e.volume("b").unwrap();
    assert!(
        e.volume_read_only(b),
        "volume b served writable without its map"
    );
    // closing (a checkpoint) does not make a map of the journal's pages
    e.close().unwrap();
    drop(e);
    assert!(
        !map_b.exists(),
        "a map was made of the journal's pages alone"
    );
    let check = fsck(&crash, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4, "{check:?}");
    assert!(
        check
            .data_lost
            .iter()
            .any(|l| l.contains("volume b: its map file is missing")),
        "{check:?}"
    );
    assert_eq!(repair(&crash), 1);
    assert_intact(&crash, &[("a", 600)]);

    // a volume created since the last checkpoint has no map file yet: not
    // damage
    let d = tempfile::tempdir().unwrap();
    let crash = crash_image_with_a_new_volume(d.path());
    assert_eq!(std::fs::read_dir(crash.join("maps")).unwrap().count(), 2);
    assert_new_volume_served(&crash);
}

/// A crash image (`<dir>/crash`) of a [`build`] store with volume `c`
/// created since the last checkpoint, pattern 7 at its block 0.
fn crash_image_with_a_new_volume(dir: &Path) -> PathBuf {
    let path = build(dir);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let c = e.create_volume("c", 8 << 20).unwrap();
    e.write(c, 0, &pattern(7), true).unwrap();
    let crash = dir.join("crash");
    crash_copy(&path, &crash);
    drop(e);
    crash
}

/// Volume `c` of [`crash_image_with_a_new_volume`] opens writable and
/// intact, the store consistent.
fn assert_new_volume_served(store: &Path) {
    let e = Engine::open(store, EngineConfig::default()).unwrap();
    let (c, _) = e.volume("c").unwrap();
    assert!(!e.volume_read_only(c), "{:?}", e.damage());
    let mut buf = vec![0u8; 4096];
    e.read(c, 0, &mut buf).unwrap();
    assert!(buf == pattern(7));
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn flipped_reverse_index_page_is_rehashed() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    flip(&path.join("fingerprints"), 4096 + 5);
    assert!(matches!(
        Engine::open(&path, EngineConfig::default()),
        Err(EngineError::Corrupt { .. })
    ));
    assert_eq!(repair(&path), 1);
    assert_intact(&path, &[("a", 600), ("b", 100)]);
}

#[test]
fn a_map_far_longer_than_its_volume_is_read_as_cut_at_the_volume_s_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = build(dir.path());
    // a damaged length: 8 TiB, sparse (the page table of such a map would
    // take 64 MiB if it followed the length)
    let map = first_map_file(&path);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&map)
        .unwrap()
        .set_len(8 << 40)
        .unwrap();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let metadata = e.stats().metadata_bytes_in_memory;
    assert!(
        metadata < 16 << 20,
        "{metadata} bytes of metadata in memory"
    );
    assert!(e.volumes().iter().all(|v| !v.read_only));
    drop(e);
    assert_intact(&path, &[("a", 600), ("b", 100)]);
}

/// A map with pages past its volume's (a volume table older than its map):
/// read as cut at open, and cut on file by a grow, whose new LBAs read as
/// unmapped then and after a restart.
#[test]
fn a_grow_past_a_map_read_as_cut_brings_no_old_entries_back() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("store");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let v = e.create_volume("v", 16 << 20).unwrap();
    e.write(v, 0, &pattern(1), false).unwrap();
    e.write(v, 3000 * 4096, &pattern(2), false).unwrap();
    e.close().unwrap();
    drop(e);
    // the volume table says 8 MiB (2048 blocks): LBA 3000's page is past it
    let state_path = path.join("state.json");
    let mut state: dedupd_engine::store::State =
        dedupd_engine::store::decode_checked(&std::fs::read(&state_path).unwrap(), &state_path)
            .unwrap();
    state.volumes[0].size_bytes = 8 << 20;
    std::fs::write(&state_path, dedupd_engine::store::encode_checked(&state)).unwrap();
    // (the block LBA 3000 mapped is now referenced by nothing: a repair
    // frees it)
    assert_eq!(fsck_repair(&path).exit_code(), 1);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    e.resize_volume("v", 16 << 20).unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(v, 3000 * 4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "an old entry came back");
    // a new block may take the freed one
    e.write(v, 4096, &pattern(3), false).unwrap();
    e.close().unwrap();
    drop(e);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    e.read(v, 3000 * 4096, &mut buf).unwrap();
    assert!(
        buf.iter().all(|&b| b == 0),
        "an old entry came back after a restart"
    );
    e.read(v, 0, &mut buf).unwrap();
    assert!(buf == pattern(1));
    assert!(e.check().is_empty(), "{:?}", e.check());
    drop(e);
    assert_eq!(fsck(&path, FsckOptions::default()).unwrap().exit_code(), 0);
}

#[test]
fn flipped_map_page_makes_the_volume_read_only_until_repaired() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let map = first_map_file(&path);
    flip(&map, 4096 + 100); // page 1 of volume a: LBAs 508..1016
    {
        let e = Engine::open(&path, EngineConfig::default()).unwrap();
        let (a, _) = e.volume("a").unwrap();
        assert!(e.volume_read_only(a));
        assert!(matches!(
            e.write(a, 0, &[1u8; 4096], false),
            Err(EngineError::ReadOnly { .. })
        ));
        let mut buf = vec![0u8; 4096];
        e.read(a, 0, &mut buf).unwrap();
        assert!(
            buf == pattern(0),
            "undamaged page of a read-only volume reads wrong"
        );
        // the LBAs of the damaged page fail to read, not read as zeros
        // (a request reaching into it names its first LBA there)
        let mut two = vec![0u8; 8192];
        assert!(
            matches!(
                e.read(a, 507 * 4096, &mut two),
                Err(EngineError::MappingLost { lba: 508, .. })
            ),
            "a lost mapping read as a hole"
        );
        e.read(a, 1016 * 4096, &mut buf).unwrap();
        let (b, _) = e.volume("b").unwrap();
        e.write(b, 200 * 4096, &pattern(5), false).unwrap();
        e.close().unwrap();
    }
    let check = fsck(&path, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4);
    // the lost LBAs are named
    assert!(
        check
            .data_lost
            .iter()
            .any(|l| l.contains("volume a: map page [1] damaged: LBAs 508-1015 lost")),
        "{:?}",
        check.data_lost
    );
    let fixed = fsck_repair(&path);
    assert_eq!(fixed.exit_code(), 1);
    assert!(!fixed.data_lost.is_empty());
    assert_eq!(fsck(&path, FsckOptions::default()).unwrap().exit_code(), 0);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (a, _) = e.volume("a").unwrap();
    assert!(!e.volume_read_only(a));
    // (unmapped by the repair, which listed them as lost)
    let mut buf = vec![1u8; 4096];
    e.read(a, 508 * 4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    e.write(a, 0, &[1u8; 4096], false).unwrap();
    assert!(e.check().is_empty());
}

#[test]
fn flipped_state_counters_and_superblock_are_refused_with_names() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    flip(&path.join("state.json"), 20);
    match Engine::open(&path, EngineConfig::default()) {
        Err(EngineError::Corrupt { file, .. }) => assert!(file.ends_with("state.json")),
        other => panic!("{:?}", other.err()),
    }
    let path3 = build(&d.path().join("3"));
    flip(&path3.join("counters.json"), 20);
    match Engine::open(&path3, EngineConfig::default()) {
        Err(EngineError::Corrupt { file, .. }) => assert!(file.ends_with("counters.json")),
        other => panic!("{:?}", other.err()),
    }
    std::fs::remove_file(path3.join("counters.json")).unwrap();
    match Engine::open(&path3, EngineConfig::default()) {
        Err(EngineError::Corrupt { file, detail }) => {
            assert!(file.ends_with("counters.json") && detail.contains("missing"));
            assert!(
                detail.contains("fsck --repair") && !detail.contains("  "),
                "{detail}"
            );
        }
        other => panic!("{:?}", other.err()),
    }
    // statistics and the journal's sequence: a repair writes them anew
    let check = fsck(&path3, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4, "{:?}", check.problems);
    assert!(check.problems.iter().any(|p| p.contains("counters.json")));
    let fixed = fsck_repair(&path3);
    assert_eq!(fixed.exit_code(), 1);
    assert_eq!(fsck(&path3, FsckOptions::default()).unwrap().exit_code(), 0);
    let e = Engine::open(&path3, EngineConfig::default()).unwrap();
    assert_eq!(e.stats().blocks_written, 0);
    let (a, _) = e.volume("a").unwrap();
    let mut back = vec![0u8; 4096];
    e.read(a, 599 * 4096, &mut back).unwrap();
    assert_eq!(back, pattern(599));
    e.write(a, 0, &[3; 4096], false).unwrap();
    e.flush().unwrap();
    e.drop_without_closing();
    let e = Engine::open(&path3, EngineConfig::default()).unwrap();
    assert_eq!(e.stats().blocks_written, 1);
    let path2 = build(&d.path().join("2"));
    flip(&path2.join("superblock"), 20);
    let err = Engine::open(&path2, EngineConfig::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("fsck") && err.contains("superblock"), "{err}");
}

/// A damaged volume table (`state.json`): the store is refused with the
/// fsck command to run; fsck rebuilds the table from the volume maps,
/// keeping what the damaged file still says where the maps agree, and
/// the data is served as before.
#[test]
fn fsck_rebuilds_a_damaged_volume_table_from_the_maps() {
    let d = tempfile::tempdir().unwrap();
    // a name changed (still JSON, checksum wrong): kept as the file says;
    // garbage: names made up from the volume ids
    for (case, damage) in [("renamed", 0), ("garbage", 1)] {
        let path = build(&d.path().join(case));
        let state = path.join("state.json");
        if damage == 0 {
            let text = std::fs::read_to_string(&state).unwrap();
            std::fs::write(&state, text.replacen("\"b\"", "\"c\"", 1)).unwrap();
        } else {
            std::fs::write(&state, b"\x00\x17 not json at all").unwrap();
        }
        let err = Engine::open(&path, EngineConfig::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("state.json") && err.contains("fsck --repair"),
            "{err}"
        );
        let check = fsck(&path, FsckOptions::default()).unwrap();
        assert_eq!(check.exit_code(), 4, "{:?}", check.problems);
        let said = check
            .problems
            .iter()
            .find(|p| p.contains("state.json"))
            .unwrap_or_else(|| panic!("{:?}", check.problems));
        let names: [&str; 2] = if damage == 0 {
            assert!(
                said.contains("\"c\"") && said.contains("as state.json gave it"),
                "{said}"
            );
            ["a", "c"]
        } else {
            assert!(
                said.contains("does not parse") && said.contains("volume-1"),
                "{said}"
            );
            // (named by their ids, which `build` makes 1 and 2)
            ["volume-1", "volume-2"]
        };
        let fixed = fsck_repair(&path);
        assert_eq!(fixed.exit_code(), 1, "{:?}", fixed.problems);
        assert_eq!(fsck(&path, FsckOptions::default()).unwrap().exit_code(), 0);
        assert_intact(&path, &[(names[0], 600), (names[1], 100)]);
        let e = Engine::open(&path, EngineConfig::default()).unwrap();
        // (sizes: as they were, or what the maps hold, 8 MiB at least)
        for name in names {
            assert!(e.volume(name).unwrap().1 >= 8 << 20, "{name}");
        }
        // a new volume gets a new id
        let c = e.create_volume("new", 1 << 20).unwrap();
        assert!(c.0 >= 3, "{c:?}");
        e.close().unwrap();
    }
}

/// A superblock lost or damaged: fsck rebuilds it from the rest of the
/// store (the fingerprint algorithm told from the stored blocks), and the
/// store serves as before, dedup against its old blocks included.
#[test]
fn fsck_rebuilds_a_lost_superblock() {
    for (hash, lose) in [
        (HashAlgorithm::Sha256, "flip"),
        (HashAlgorithm::Blake3, "flip"),
        (HashAlgorithm::Blake3, "remove"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("store");
        let e = Engine::create(&path, hash, EngineConfig::default()).unwrap();
        let a = e.create_volume("a", 8 << 20).unwrap();
        let data: Vec<u8> = (0..300).flat_map(pattern).collect();
        e.write(a, 0, &data, false).unwrap();
        e.close().unwrap();
        drop(e);
        let original = std::fs::read(path.join("superblock")).unwrap();
        if lose == "flip" {
            flip(&path.join("superblock"), 20);
        } else {
            std::fs::remove_file(path.join("superblock")).unwrap();
        }
        match Engine::open(&path, EngineConfig::default()) {
            // a damaged superblock is named as such, a lost one as missing
            Err(EngineError::Corrupt { file, detail }) if lose == "flip" => {
                assert!(file.ends_with("superblock"), "{file:?}");
                assert!(detail.contains("fsck --repair"), "{detail}");
            }
            Err(EngineError::NotAStore { .. }) if lose == "remove" => {}
            other => panic!("{lose}: {:?}", other.err()),
        }
        let check = fsck(&path, FsckOptions::default()).unwrap();
        assert_eq!(check.exit_code(), 4, "{check:?}");
        assert!(check.problems[0].contains(hash.name()), "{check:?}");
        let fixed = fsck_repair(&path);
        assert_eq!(fixed.exit_code(), 1, "{fixed:?}");
        assert_eq!(fsck(&path, FsckOptions::default()).unwrap().exit_code(), 0);
        let rebuilt = std::fs::read(path.join("superblock")).unwrap();
        assert!(
            rebuilt == original,
            "{hash:?}/{lose}: the superblock differs"
        );
        let e = Engine::open(&path, EngineConfig::default()).unwrap();
        let (a, _) = e.volume("a").unwrap();
        let stored = e.stats().physical_blocks_stored;
        e.write(a, 400 * 4096, &pattern(7), true).unwrap();
        assert_eq!(
            e.stats().physical_blocks_stored,
            stored,
            "{hash:?}: no dedup"
        );
        let mut buf = vec![0u8; 4096];
        e.read(a, 299 * 4096, &mut buf).unwrap();
        assert!(buf == pattern(299));
    }
    // not a store: a directory without a state stays refused
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("superblock"), b"junk").unwrap();
    assert!(matches!(
        fsck(d.path(), FsckOptions::default()),
        Err(EngineError::NotAStore { .. })
    ));
}

/// A crash image (`<dir>/crash`) of a [`build`] store with one more
/// commit still in its journal: pattern 1 at block 300 of volume `b`.
fn crash_image_with_a_commit(dir: &Path) -> PathBuf {
    let path = build(dir);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (b, _) = e.volume("b").unwrap();
    e.write(b, 300 * 4096, &pattern(1), true).unwrap();
    let crash = dir.join("crash");
    crash_copy(&path, &crash);
    drop(e);
    crash
}

/// Copies a store directory as it is on disk now (a crash image).
fn crash_copy(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst.join("maps")).unwrap();
    for sub in ["", "maps"] {
        for e in std::fs::read_dir(src.join(sub)).unwrap().flatten() {
            if e.file_type().unwrap().is_file() && e.file_name() != "lock" {
                std::fs::copy(e.path(), dst.join(sub).join(e.file_name())).unwrap();
            }
        }
    }
}

#[test]
fn torn_last_journal_record_loses_only_that_commit() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (b, _) = e.volume("b").unwrap();
    e.write(b, 300 * 4096, &pattern(1), true).unwrap(); // committed
    let committed_len = std::fs::metadata(path.join("journal")).unwrap().len();
    e.write(b, 301 * 4096, &pattern(2), true).unwrap(); // to be torn
    let full_len = std::fs::metadata(path.join("journal")).unwrap().len();
    assert!(full_len > committed_len);
    let crash = d.path().join("crash");
    crash_copy(&path, &crash);
    drop(e);
    for cut in [1, 9, (full_len - committed_len) / 2] {
        let img = d.path().join(format!("crash-{cut}"));
        crash_copy(&crash, &img);
        let j = std::fs::OpenOptions::new()
            .write(true)
            .open(img.join("journal"))
            .unwrap();
        j.set_len(full_len - cut).unwrap();
        let e = Engine::open(&img, EngineConfig::default()).unwrap();
        let (b, _) = e.volume("b").unwrap();
        let mut buf = vec![0u8; 4096];
        e.read(b, 300 * 4096, &mut buf).unwrap();
        assert!(buf == pattern(1), "committed write lost (cut {cut})");
        e.read(b, 301 * 4096, &mut buf).unwrap();
        assert!(
            buf.iter().all(|&x| x == 0),
            "torn commit half-applied (cut {cut})"
        );
        assert!(e.check().is_empty(), "{:?}", e.check());
        // (said: bit rot of a last commit looks the same)
        assert!(
            e.notes()
                .iter()
                .any(|n| n.contains("last transaction") && n.contains("not replayed")),
            "cut {cut}: {:?}",
            e.notes()
        );
        drop(e);
        assert_eq!(
            fsck(
                &img,
                FsckOptions {
                    repair: false,
                    rehash: true
                }
            )
            .unwrap()
            .exit_code(),
            0
        );
    }
}

/// One flipped bit in a transaction that has intact ones after it: not a
/// torn end (only the last transaction written can be torn) but damage,
/// which would lose the acknowledged commits after it. The store is not
/// served; fsck reports it and a repair rebuilds a consistent store.
#[test]
fn a_damaged_transaction_before_intact_ones_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (b, _) = e.volume("b").unwrap();
    e.write(b, 300 * 4096, &pattern(1), true).unwrap();
    let first_len = std::fs::metadata(path.join("journal")).unwrap().len();
    e.write(b, 301 * 4096, &pattern(2), true).unwrap();
    e.write(b, 302 * 4096, &pattern(3), true).unwrap();
    let crash = d.path().join("crash");
    crash_copy(&path, &crash);
    drop(e);
    // the torn end of the same image is no damage
    let torn = d.path().join("torn");
    crash_copy(&crash, &torn);
    let len = std::fs::metadata(torn.join("journal")).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(torn.join("journal"))
        .unwrap()
        .set_len(len - 7)
        .unwrap();
    drop(Engine::open(&torn, EngineConfig::default()).unwrap());

    flip(&crash.join("journal"), first_len / 2);
    match Engine::open(&crash, EngineConfig::default()) {
        Err(EngineError::Corrupt { file, detail }) => {
            assert!(file.ends_with("journal"), "{file:?}");
            assert!(detail.contains("fsck --repair"), "{detail}");
        }
        other => panic!("opened over a damaged transaction: {:?}", other.err()),
    }
    let before = store_files(&crash);
    let check = fsck(&crash, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4, "{check:?}");
    assert!(
        check.problems.iter().any(|p| p.contains("journal")),
        "{check:?}"
    );
    // (but the on-disk fingerprint groups: derived data, rebuilt by
    // every open from the reverse index as the chain left it)
    let after = store_files(&crash);
    for (f, b) in before.iter().filter(|(f, _)| !f.ends_with("fpgroups")) {
        assert!(after.get(f) == Some(b), "the check changed {f:?}");
    }
    assert_eq!(after.len(), before.len(), "the check made files");
    let fixed = fsck_rehash_repair(&crash);
    assert_eq!(fixed.exit_code(), 1, "{fixed:?}");
    let again = fsck(
        &crash,
        FsckOptions {
            repair: false,
            rehash: true,
        },
    )
    .unwrap();
    assert_eq!(again.exit_code(), 0, "{again:?}");
    assert_intact(&crash, &[("a", 600), ("b", 100)]);
}

/// A missing journal loses the commits since the last checkpoint: the
/// store is not served; fsck says so without creating it, and a repair
/// creates it. A missing data file with blocks referenced stops fsck too
/// (nothing can be repaired without it); in an empty store it is created.
#[test]
fn missing_journal_or_data_file_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    std::fs::remove_file(path.join("journal")).unwrap();
    match Engine::open(&path, EngineConfig::default()) {
        Err(EngineError::Corrupt { file, detail }) => {
            assert!(file.ends_with("journal"), "{file:?}");
            assert!(detail.contains("missing"), "{detail}");
        }
        other => panic!("opened without its journal: {:?}", other.err()),
    }
    let check = fsck(&path, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4, "{check:?}");
    assert!(
        !path.join("journal").exists(),
        "a check created the journal"
    );
    // a repair without --rehash is refused: blocks the lost commits freed
    // may hold other data now
    let plain = fsck_repair(&path);
    assert_eq!(plain.exit_code(), 4, "{plain:?}");
    assert!(plain.journal_lost_commits);
    assert!(
        plain.data_lost.iter().any(|l| l.starts_with("journal: ")),
        "{:?}",
        plain.data_lost
    );
    assert!(
        plain
            .problems
            .iter()
            .any(|p| p.contains("--repair --rehash")),
        "{:?}",
        plain.problems
    );
    assert!(!path.join("journal").exists());
    let fixed = fsck_rehash_repair(&path);
    assert_eq!(fixed.exit_code(), 1, "{fixed:?}");
    assert!(path.join("journal").exists());
    assert!(!path.join("journal.repair").exists());
    // with the superblock lost too, the refused repair still changes
    // nothing: no superblock written, nothing put in place
    let both = build(&d.path().join("both"));
    std::fs::remove_file(both.join("journal")).unwrap();
    std::fs::remove_file(both.join("superblock")).unwrap();
    let before = store_files(&both);
    let plain = fsck_repair(&both);
    assert_eq!(plain.exit_code(), 4, "{plain:?}");
    assert!(plain.repair_refused && !plain.repaired);
    let after = store_files(&both);
    let changed: Vec<_> = after
        .iter()
        // (the on-disk fingerprint groups are rebuilt at every open)
        .filter(|(p, b)| before.get(*p) != Some(b) && !p.ends_with("fpgroups"))
        .map(|(p, _)| p.clone())
        .collect();
    assert!(
        changed.is_empty() && after.len() == before.len(),
        "a refused repair wrote the store: {changed:?}"
    );
    // a repair killed before its commit leaves its journal under the
    // other name: the store stays refused, and the next repair goes on
    let again = build(&d.path().join("again"));
    std::fs::remove_file(again.join("journal")).unwrap();
    std::fs::write(again.join("journal.repair"), b"").unwrap();
    assert!(Engine::open(&again, EngineConfig::default()).is_err());
    assert_eq!(fsck(&again, FsckOptions::default()).unwrap().exit_code(), 4);
    let fixed = fsck_rehash_repair(&again);
    assert_eq!(fixed.exit_code(), 1, "{fixed:?}");
    assert_intact(&again, &[("a", 600), ("b", 100)]);
    assert_eq!(fsck(&path, FsckOptions::default()).unwrap().exit_code(), 0);
    assert_intact(&path, &[("a", 600), ("b", 100)]);

    std::fs::remove_file(path.join("data")).unwrap();
    for r in [
        Engine::open(&path, EngineConfig::default()).err(),
        fsck(&path, FsckOptions::default()).err(),
    ] {
        match r {
            Some(EngineError::Corrupt { file, detail }) => {
                assert!(file.ends_with("data"), "{file:?}");
                assert!(detail.contains("missing"), "{detail}");
            }
            other => panic!("no error without the data file: {other:?}"),
        }
        assert!(!path.join("data").exists(), "the data file was created");
    }

    let empty = d.path().join("empty");
    drop(Engine::create(&empty, HashAlgorithm::Sha256, EngineConfig::default()).unwrap());
    std::fs::remove_file(empty.join("data")).unwrap();
    assert_eq!(fsck(&empty, FsckOptions::default()).unwrap().exit_code(), 0);
    assert!(
        !empty.join("data").exists(),
        "a check created the data file"
    );
    let e = Engine::open(&empty, EngineConfig::default()).unwrap();
    let v = e.create_volume("v", 1 << 20).unwrap();
    e.write(v, 0, &pattern(1), true).unwrap();
    assert!(empty.join("data").exists());
}

#[test]
fn verify_refuses_to_share_a_block_whose_bytes_differ() {
    // a stored block rots on disk; writing its original content again
    // dedups onto the rotten copy without verify, and is stored anew with it
    for verify in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s");
        let config = EngineConfig {
            verify,
            ..EngineConfig::default()
        };
        let e = Engine::create(&path, HashAlgorithm::Sha256, config.clone()).unwrap();
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.write(v, 0, &pattern(1), true).unwrap();
        flip(&path.join("data"), 100);
        e.write(v, 4096, &pattern(1), true).unwrap();
        let mut buf = vec![0u8; 4096];
        e.read(v, 4096, &mut buf).unwrap();
        let s = e.stats();
        assert!(e.check().is_empty(), "{:?}", e.check());
        if verify {
            assert!(
                buf == pattern(1),
                "verify shared a block with different bytes"
            );
            assert_eq!(s.verify_mismatches, 1);
            assert_eq!(s.physical_blocks_stored, 2);
            // nor do the out-of-line passes merge the good copy onto the
            // rotten one (their fingerprints are the same), before or
            // after a restart rebuilt the index from both
            e.dedup_pass(1 << 20).unwrap();
            e.dedup_offline(None, &mut |_, _| {}).unwrap();
            // (the passes' mismatches changed no metadata: the close
            // commits them all the same)
            let mismatches = e.stats().verify_mismatches;
            assert!(mismatches > 1, "{mismatches}");
            e.close().unwrap();
            drop(e);
            let e = Engine::open(&path, config.clone()).unwrap();
            assert_eq!(e.stats().verify_mismatches, mismatches);
            e.dedup_pass(1 << 20).unwrap();
            e.dedup_offline(None, &mut |_, _| {}).unwrap();
            e.read(v, 4096, &mut buf).unwrap();
            assert!(
                buf == pattern(1),
                "an out-of-line pass merged different bytes"
            );
            assert_eq!(e.stats().physical_blocks_stored, 2);
            assert!(e.check().is_empty(), "{:?}", e.check());
            e.close().unwrap();
            drop(e);
            // a command opening the store between runs of the server
            // (`dedupd dedup --offline`, `fsck`) verifies as the server
            // did, whatever its own configuration says, and leaves the
            // setting recorded
            let between_runs = EngineConfig {
                settings_from_store: true,
                ..EngineConfig::default()
            };
            for _ in 0..2 {
                let e = Engine::open(&path, between_runs.clone()).unwrap();
                e.dedup_offline(None, &mut |_, _| {}).unwrap();
                e.read(v, 4096, &mut buf).unwrap();
                assert!(
                    buf == pattern(1),
                    "an offline pass between runs merged different bytes"
                );
                e.close().unwrap();
            }
            // a server started without verify records that instead
            Engine::open(&path, EngineConfig::default())
                .unwrap()
                .close()
                .unwrap();
            let e = Engine::open(&path, between_runs).unwrap();
            e.dedup_offline(None, &mut |_, _| {}).unwrap();
            assert_eq!(e.stats().physical_blocks_stored, 1);
        } else {
            assert!(
                buf != pattern(1),
                "the rotten block was expected to be shared"
            );
            assert_eq!(s.physical_blocks_stored, 1);
            assert!(e.check().is_empty(), "{:?}", e.check());
        }
    }
}

/// A map page that goes bad on disk while the store is open, after it left
/// memory: the read that needs it fails (never zeros for mapped data),
/// writes and flushes fail from then on (nothing derived from it is
/// committed), other pages keep reading, and the next start names the
/// damage.
#[test]
fn map_page_damaged_while_paged_out_fails_the_access_and_stops_commits() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let cfg = EngineConfig {
        map_cache_bytes: 4064, // one page for every map and the refcounts
        ..EngineConfig::default()
    };
    let e = Engine::open(&path, cfg.clone()).unwrap();
    let (a, _) = e.volume("a").unwrap();
    let (b, _) = e.volume("b").unwrap();
    let mut buf = vec![0u8; 4096];
    // touch b's map, so a's pages leave memory
    e.read(b, 0, &mut buf).unwrap();
    assert_eq!(buf, pattern(0));
    assert!(e.stats().map_cache.pages_evicted > 0);
    // acknowledged, not yet flushed
    e.write(b, 300 * 4096, &pattern(7), false).unwrap();
    let map = first_map_file(&path);
    flip(&map, 4096 + 100); // page 1 of volume a: LBAs 508..1016
    let err = e.read(a, 510 * 4096, &mut buf).unwrap_err();
    assert!(
        matches!(err, EngineError::MetadataUnreadable(ref m) if m.contains("page 1 of")),
        "{err}"
    );
    assert_eq!(e.stats().map_cache.load_errors, 1);
    // page 0 of a still reads
    e.read(a, 3 * 4096, &mut buf).unwrap();
    assert_eq!(buf, pattern(3));
    assert!(matches!(
        e.write(b, 301 * 4096, &pattern(8), false),
        Err(EngineError::MetadataUnreadable(_))
    ));
    // the pending write cannot be made durable: the flush says so
    assert!(matches!(e.flush(), Err(EngineError::MetadataUnreadable(_))));
    drop(e);
    // the next start checks every page: volume a is read-only, b intact
    let e = Engine::open(&path, cfg).unwrap();
    let (a, _) = e.volume("a").unwrap();
    let (b, _) = e.volume("b").unwrap();
    assert!(e.volume_read_only(a));
    for k in [0u64, 50, 99] {
        e.read(b, k * 4096, &mut buf).unwrap();
        assert_eq!(buf, pattern(k));
    }
    drop(e);
    assert_eq!(fsck(&path, FsckOptions::default()).unwrap().exit_code(), 4);
}

/// A reference-count page that goes bad on disk while paged out: the write
/// that releases or shares a block on it fails, nothing is committed from
/// then on, and the next start refuses the store and names the file until
/// fsck rebuilds it.
#[test]
fn refcount_page_damaged_while_paged_out_stops_writes_until_repaired() {
    refcount_page_damaged_while_paged_out(|p| flip(p, 10));
}

#[test]
fn refcount_page_zeroed_while_paged_out_stops_writes_until_repaired() {
    // zeros read back for a page that held counts are damage too, not
    // counts of 0 (which would free blocks other LBAs share)
    refcount_page_damaged_while_paged_out(|p| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        f.write_all_at(&[0u8; 4096], 0).unwrap();
    });
}

/// Pages the reference counts out, damages their file with `damage`, and
/// checks that a write releasing a block counted there fails, commits
/// stop, the store then refuses to open, and fsck repairs it.
fn refcount_page_damaged_while_paged_out(damage: impl Fn(&Path)) {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let cfg = EngineConfig {
        map_cache_bytes: 4064,
        ..EngineConfig::default()
    };
    let e = Engine::open(&path, cfg.clone()).unwrap();
    let (a, _) = e.volume("a").unwrap();
    let (b, _) = e.volume("b").unwrap();
    let mut buf = vec![0u8; 4096];
    // map pages of a and b in turn, then a checkpoint: every array of the
    // group sheds pages down to the budget, the reference counts too
    e.read(a, 550 * 4096, &mut buf).unwrap();
    e.read(b, 0, &mut buf).unwrap();
    e.checkpoint().unwrap();
    assert!(e.stats().map_cache.pages_evicted > 0);
    damage(&path.join("refcounts"));
    // overwriting LBA 1 of b releases its block: its count is on the bad page
    let err = e.write(b, 4096, &pattern(900), false).unwrap_err();
    assert!(matches!(err, EngineError::MetadataUnreadable(_)), "{err}");
    assert!(matches!(e.flush(), Err(EngineError::MetadataUnreadable(_))));
    // reads that need only the maps keep working
    e.read(a, 7 * 4096, &mut buf).unwrap();
    assert_eq!(buf, pattern(7));
    drop(e);
    match Engine::open(&path, cfg.clone()) {
        Err(EngineError::Corrupt { file, .. }) => assert!(file.ends_with("refcounts")),
        Err(other) => panic!("unexpected error: {other}"),
        Ok(_) => panic!("opened a store with a damaged reference-count page"),
    }
    assert_eq!(repair(&path), 1);
    assert_intact(&path, &[("a", 600), ("b", 100)]);
}

#[test]
fn rehash_reports_rotten_data_as_lost_and_a_repair_stops_sharing_it() {
    // block 5 of volume a (content pattern(5), also mapped by volume b)
    // rots on disk: the check names it as data lost; the repair says the
    // same, re-fingerprints it, and a new write of the old content is then
    // stored anew instead of sharing the rotten copy
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (a, _) = e.volume("a").unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(a, 5 * 4096, &mut buf).unwrap();
    drop(e);
    let data = std::fs::read(path.join("data")).unwrap();
    let at = data
        .chunks(4096)
        .position(|c| c == buf.as_slice())
        .expect("block 5 stored") as u64;
    flip(&path.join("data"), at * 4096 + 17);
    let rehash = |repair| {
        fsck(
            &path,
            FsckOptions {
                repair,
                rehash: true,
            },
        )
        .unwrap()
    };
    let check = rehash(false);
    assert_eq!(check.exit_code(), 4, "{check:?}");
    assert_eq!(check.corrupted_blocks, 1);
    // the block, then the LBAs that read it, by volume
    assert_eq!(
        check.data_lost,
        [
            format!(
                "PBA {at}: its data changed on disk; the 2 LBA(s) mapping it read the changed bytes"
            ),
            "volume a: LBA 5 read a damaged block (named above by PBA)".to_string(),
            "volume b: LBA 5 read a damaged block (named above by PBA)".to_string(),
        ]
    );
    let fixed = rehash(true);
    assert_eq!(fixed.exit_code(), 1, "{fixed:?}");
    assert_eq!(fixed.corrupted_blocks, 1);
    assert!(
        fixed.data_lost[0].contains("re-fingerprinted"),
        "{:?}",
        fixed.data_lost
    );
    assert_eq!(rehash(false).exit_code(), 0);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let stored = e.stats().physical_blocks_stored;
    let c = e.create_volume("c", 1 << 20).unwrap();
    e.write(c, 0, &pattern(5), true).unwrap();
    e.read(c, 0, &mut buf).unwrap();
    assert!(buf == pattern(5), "a new write shared the rotten copy");
    assert_eq!(e.stats().physical_blocks_stored, stored + 1);
}

#[test]
fn a_truncated_data_file_is_reported_and_its_missing_blocks_unmapped() {
    truncated_data_file(300 * 4096);
}

#[test]
fn a_data_file_cut_inside_a_block_loses_that_block() {
    // the last 3096 bytes of block 300 gone: lost as the blocks past it
    truncated_data_file(300 * 4096 + 1000);
}

/// Cuts the data file of the store [`build`] makes to `len_bytes` (in
/// block 300 or at its start) and checks it is refused, reported, and
/// repaired by unmapping the 300 LBAs of volume a past the cut.
fn truncated_data_file(len_bytes: u64) {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let data = std::fs::OpenOptions::new()
        .write(true)
        .open(path.join("data"))
        .unwrap();
    data.set_len(len_bytes).unwrap();
    drop(data);
    // not served: the free space below the blocks lost cannot be told
    match Engine::open(&path, EngineConfig::default()) {
        Err(EngineError::Corrupt { file, detail }) => {
            assert!(file.ends_with("data"), "{file:?}");
            assert!(detail.contains("fsck --repair"), "{detail}");
        }
        other => panic!("a data file cut short opened: {:?}", other.err()),
    }
    let check = fsck(&path, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4, "{check:?}");
    // volume a's blocks 300..600 were stored past the new end
    assert_eq!(check.lbas_outside_data_file, 300);
    // (their blocks, past the end, are not leaked space)
    assert_eq!(check.leaked_blocks, 0, "{check:?}");
    // (named as one run, not 300 lines)
    assert_eq!(
        check.data_lost,
        ["volume a: LBAs 300-599 (300) unmapped (data missing)"]
    );
    // their PBAs too, as one run with the same count problem
    let past_end: Vec<&String> = check
        .problems
        .iter()
        .filter(|l| l.contains("past the end of the data file") && l.starts_with("PBA"))
        .collect();
    assert_eq!(
        past_end,
        ["PBAs 300-599 (300): reference count 1, mapped by 0 LBA(s) (past the end of the data file)"],
        "{:?}",
        check.problems
    );
    assert_eq!(
        (check.problems_not_listed, check.data_lost_not_listed),
        (0, 0)
    );
    let fixed = fsck_rehash_repair(&path);
    assert_eq!(fixed.exit_code(), 1, "{fixed:?}");
    assert_eq!(
        fsck(
            &path,
            FsckOptions {
                repair: false,
                rehash: true
            }
        )
        .unwrap()
        .exit_code(),
        0
    );
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (a, _) = e.volume("a").unwrap();
    let mut buf = vec![0u8; 4096];
    for i in [0u64, 299, 300, 599] {
        e.read(a, i * 4096, &mut buf).unwrap();
        if i < 300 {
            assert!(buf == pattern(i), "block {i} lost");
        } else {
            assert!(buf.iter().all(|&b| b == 0), "block {i} still mapped");
        }
    }
    assert!(e.check().is_empty(), "{:?}", e.check());
}

/// Data, reference-count and reverse-index files made 1 TiB long by a
/// hole at their end (a damaged length, or a crash after writes never
/// committed) cost neither memory nor a scan: nothing past the last
/// referenced block enters the free set (those blocks are counted free,
/// and taken in order as the file's growth would), and the store serves as
/// before.
#[test]
fn long_sparse_metadata_and_data_files_cost_nothing_at_open() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let before = Engine::open(&path, EngineConfig::default())
        .unwrap()
        .stats();
    for name in ["data", "refcounts", "fingerprints"] {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path.join(name))
            .unwrap();
        f.set_len(1 << 40).unwrap();
    }
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let s = e.stats();
    // (the blocks between the last allocated one and the file's end are
    // counted free, as the ones the file's growth would take next; none is
    // held in the free set)
    assert_eq!(s.data_file_bytes, 1 << 40);
    assert_eq!(
        s.free_blocks,
        before.free_blocks + ((1u64 << 40) - before.data_file_bytes) / 4096,
        "{s:?}"
    );
    assert_eq!(s.physical_blocks_stored, before.physical_blocks_stored);
    assert!(
        s.metadata_bytes_in_memory < before.metadata_bytes_in_memory + (16 << 20),
        "{} bytes in memory, {} before",
        s.metadata_bytes_in_memory,
        before.metadata_bytes_in_memory
    );
    let (a, _) = e.volume("a").unwrap();
    e.write(a, 700 * 4096, &pattern(700), true).unwrap();
    assert!(e.check().is_empty(), "{:?}", e.check());
    e.close().unwrap();
    drop(e);
    let r = fsck(&path, FsckOptions::default()).unwrap();
    assert_eq!(r.exit_code(), 0, "{r:?}");
    assert_intact(&path, &[("a", 600), ("b", 100)]);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(e.volume("a").unwrap().0, 700 * 4096, &mut buf)
        .unwrap();
    assert!(buf == pattern(700));
}

/// Every file of a store directory (but `lock`) with its bytes.
fn store_files(dir: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    for sub in ["", "maps"] {
        for e in std::fs::read_dir(dir.join(sub)).unwrap().flatten() {
            if e.file_type().unwrap().is_file() && e.file_name() != "lock" {
                files.insert(e.path(), std::fs::read(e.path()).unwrap());
            }
        }
    }
    files
}

#[test]
fn a_check_without_repair_writes_nothing() {
    // a crash image with commits still in the journal: the check replays
    // them in memory and leaves every file as it found it (e2fsck -n)
    let d = tempfile::tempdir().unwrap();
    let crash = crash_image_with_a_commit(d.path());
    let before = store_files(&crash);
    for rehash in [false, true] {
        let r = fsck(
            &crash,
            FsckOptions {
                repair: false,
                rehash,
            },
        )
        .unwrap();
        assert_eq!(r.exit_code(), 0, "{r:?}");
        assert!(store_files(&crash) == before, "the check changed the store");
    }
    // and the store still opens with the journal's commit in it
    assert_intact(&crash, &[("a", 600), ("b", 100)]);
    let e = Engine::open(&crash, EngineConfig::default()).unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(e.volume("b").unwrap().0, 300 * 4096, &mut buf)
        .unwrap();
    assert!(buf == pattern(1));
}

/// A map file cut short (at a page boundary, so every page left passes its
/// checksum): the volume is served read-only and fsck names the LBAs lost
/// past the cut, instead of their reading as never written with nothing
/// said; a repair gives the file back its length.
#[test]
fn truncated_map_is_damage_not_a_hole() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let e = cut_first_map_after_page_0(&path, &[508, 550]);
    let (a, _) = e.volume("a").unwrap();
    e.write(a, 550 * 4096, &pattern(550), false).unwrap();
    assert!(e.check().is_empty(), "{:?}", e.check());
}

/// Cuts the map of volume `a` of [`build`] after its page 0 (LBAs 0..508
/// of its 600) and checks what follows: the volume is read-only, LBA 10
/// intact, the first of `lost` (each at or past 508) fails to read, fsck
/// names the LBAs from 508 on, a repair gives the volume back writable
/// with every LBA of `lost` reading zeros. Returns the repaired store,
/// open.
fn cut_first_map_after_page_0(path: &Path, lost: &[u64]) -> Engine {
    cut_first_map_after_page_0_then(path, lost, true)
}

/// [`cut_first_map_after_page_0`], with the store opened (and closed)
/// once before the check if `open_first`, else checked and repaired first.
fn cut_first_map_after_page_0_then(path: &Path, lost: &[u64], open_first: bool) -> Engine {
    let map = first_map_file(path);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&map)
        .unwrap()
        .set_len(4096)
        .unwrap();
    if open_first {
        let e = Engine::open(path, EngineConfig::default()).unwrap();
        let (a, _) = e.volume("a").unwrap();
        assert!(e.volume_read_only(a), "{:?}", e.damage());
        assert!(
            e.damage()
                .iter()
                .any(|d| d.describe().contains("truncated")),
            "{:?}",
            e.damage()
        );
        let mut buf = vec![0u8; 4096];
        e.read(a, 10 * 4096, &mut buf).unwrap();
        assert!(buf == pattern(10));
        assert!(matches!(
            e.read(a, lost[0] * 4096, &mut buf),
            Err(EngineError::MappingLost { lba, .. }) if lba == lost[0]
        ));
        e.close().unwrap();
    }
    let check = fsck(path, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4, "{check:?}");
    assert!(
        check
            .data_lost
            .iter()
            .any(|l| l.contains("volume a") && l.contains("from 508 on")),
        "{:?}",
        check.data_lost
    );
    assert_eq!(repair(path), 1);
    let e = Engine::open(path, EngineConfig::default()).unwrap();
    let (a, _) = e.volume("a").unwrap();
    assert!(!e.volume_read_only(a));
    let mut buf = vec![0u8; 4096];
    e.read(a, 10 * 4096, &mut buf).unwrap();
    assert!(buf == pattern(10));
    for &lba in lost {
        e.read(a, lba * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "LBA {lba}");
    }
    assert!(e.check().is_empty(), "{:?}", e.check());
    e
}

/// A map file cut short while the journal holds changes to pages past the
/// cut: replaying them must not extend the file over holes that read as
/// never written, neither at open nor when a checkpoint writes the
/// journal's pages in place. The LBAs past the cut fail to read (those the
/// journal rewrote included: their pages are dropped as a missing map's
/// are), fsck names them, and a repair unmaps them.
#[test]
fn truncated_map_with_journaled_pages_past_the_cut_is_damage() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    {
        // LBA 1100 (map page 2) written and committed, not checkpointed
        let e = Engine::open(&path, EngineConfig::default()).unwrap();
        let (a, _) = e.volume("a").unwrap();
        e.write(a, 1100 * 4096, &pattern(1100), false).unwrap();
        e.flush().unwrap();
        e.drop_without_closing();
    }
    let copy = d.path().join("copy");
    crash_copy(&path, &copy);
    cut_first_map_after_page_0(&path, &[520, 1100]);
    // fsck first: it neither counts nor keeps the journal's page past the
    // cut (a reference count its repair would leave no LBA behind)
    let e = cut_first_map_after_page_0_then(&copy, &[520, 1100], false);
    e.close().unwrap();
    drop(e);
    let check = fsck(&copy, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 0, "{check:?}");
}

/// Copies the store at every journal sync until the first change to
/// another metadata file: what a crash after a repair's commit and before
/// its checkpoint leaves.
struct CopyBeforeCheckpoint {
    store: PathBuf,
    copy: PathBuf,
    checkpoint_began: std::sync::atomic::AtomicBool,
}

impl dedupd_engine::observe::IoObserver for CopyBeforeCheckpoint {
    fn event(&self, e: dedupd_engine::observe::IoEvent<'_>) {
        use dedupd_engine::observe::IoEvent;
        use std::sync::atomic::Ordering;
        let file = match e {
            IoEvent::Write { file, .. }
            | IoEvent::SetLen { file, .. }
            | IoEvent::Remove { file }
            | IoEvent::Sync { file } => file,
            IoEvent::Create { .. } | IoEvent::SyncDir { .. } | IoEvent::SyncStart { .. } => return,
        };
        if self.checkpoint_began.load(Ordering::SeqCst) || file == "data" {
            return;
        }
        if file != "journal" {
            self.checkpoint_began.store(true, Ordering::SeqCst);
        } else if matches!(e, IoEvent::Sync { .. }) {
            let _ = std::fs::remove_dir_all(&self.copy);
            crash_copy(&self.store, &self.copy);
        }
    }
}

/// A [`build`] store with `name` removed, repaired by fsck; returns the
/// store as a crash after the repair's commit and before its checkpoint
/// leaves it (`<dir>/crash`).
fn crash_image_of_a_repair(dir: &Path, name: &str) -> PathBuf {
    let path = build(dir);
    std::fs::remove_file(path.join(name)).unwrap();
    let crash = dir.join("crash");
    let observer = std::sync::Arc::new(CopyBeforeCheckpoint {
        store: path.clone(),
        copy: crash.clone(),
        checkpoint_began: Default::default(),
    });
    let config = EngineConfig {
        observer: dedupd_engine::observe::Observer(Some(observer.clone())),
        ..EngineConfig::default()
    };
    let opts = FsckOptions {
        repair: true,
        rehash: false,
    };
    let report = dedupd_engine::fsck::fsck_with(&path, opts, config).unwrap();
    assert_eq!(report.exit_code(), 1, "{name}: {report:?}");
    assert!(observer
        .checkpoint_began
        .load(std::sync::atomic::Ordering::SeqCst));
    assert!(
        !crash.join(name).exists(),
        "{name}: copied after the checkpoint"
    );
    crash
}

#[test]
fn a_repair_of_a_missing_file_survives_a_crash_before_its_checkpoint() {
    for name in ["maps/1", "refcounts", "fingerprints"] {
        let d = tempfile::tempdir().unwrap();
        let crash = crash_image_of_a_repair(d.path(), name);
        // the crash image opens with the repair in place
        let e = Engine::open(&crash, EngineConfig::default())
            .unwrap_or_else(|err| panic!("{name}: the repair was lost: {err}"));
        let (a, _) = e.volume("a").unwrap();
        assert!(!e.volume_read_only(a), "{name}: volume a still damaged");
        assert!(e.check().is_empty(), "{name}: {:?}", e.check());
        // a lost map's LBAs: their list was kept before the repair
        // committed, so the crash did not take the only record of them
        let lost_list = crash.join(dedupd_engine::fsck::DATA_LOST_FILE);
        if name.starts_with("maps") {
            let text = std::fs::read_to_string(&lost_list).unwrap();
            assert!(text.contains("volume a"), "{text}");
            assert!(
                e.notes().iter().any(|n| n.contains("fsck-data-lost.txt")),
                "{:?}",
                e.notes()
            );
        } else {
            assert!(!lost_list.exists(), "{name}: nothing was lost");
        }
        e.close().unwrap();
        drop(e);
        assert!(crash.join(name).exists());
        let expect_a = if name.starts_with("maps") { 0 } else { 600 };
        assert_intact(&crash, &[("a", expect_a), ("b", 100)]);
    }
}

#[test]
fn a_volume_with_a_damaged_map_is_not_resized() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let map = first_map_file(&path);
    std::fs::remove_file(&map).unwrap();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    for size in [4 << 20, 16 << 20] {
        assert!(
            matches!(
                e.resize_volume("a", size),
                Err(EngineError::ReadOnly { .. })
            ),
            "a map made anew at {size} bytes would hide its loss"
        );
    }
    // the message names the repair of this very store
    let msg = e.resize_volume("a", 4 << 20).unwrap_err().to_string();
    assert!(
        msg.contains(&format!("dedupd --store {} fsck --repair", path.display())),
        "{msg}"
    );
    e.close().unwrap();
    drop(e);
    assert!(!map.exists());
    let check = fsck(&path, FsckOptions::default()).unwrap();
    assert!(
        check
            .data_lost
            .iter()
            .any(|l| l.contains("volume a: its map file is missing")),
        "{check:?}"
    );
}

#[test]
fn a_volume_created_by_an_earlier_version_may_lack_its_map_while_the_journal_creates_it() {
    use dedupd_engine::journal::{encode_txn, read_chain, MetaFile, Op};
    use dedupd_engine::store::{decode_checked, encode_checked_compact, State};
    // a crash image with volume c created and written since the last
    // checkpoint, its journal rewritten as an earlier version wrote it:
    // the map's length alone, no removal, no mark in the volume record
    let d = tempfile::tempdir().unwrap();
    let crash = crash_image_with_a_new_volume(d.path());
    let jpath = crash.join("journal");
    let chain = read_chain(&std::fs::File::open(&jpath).unwrap()).unwrap();
    let mut old = Vec::new();
    let mut removals = 0;
    for t in chain {
        let ops: Vec<Op> = t
            .ops
            .into_iter()
            .filter_map(|op| match op {
                Op::SetLen {
                    file: MetaFile::Map(_),
                    len_bytes: 0,
                } => {
                    removals += 1;
                    None
                }
                Op::Replace {
                    file: MetaFile::State,
                    data,
                } => {
                    let mut s: State = decode_checked(&data, &jpath).unwrap();
                    for v in &mut s.volumes {
                        v.creation_marked = false;
                    }
                    Some(Op::Replace {
                        file: MetaFile::State,
                        data: encode_checked_compact(&s),
                    })
                }
                op => Some(op),
            })
            .collect();
        old.extend(encode_txn(t.seq, &ops));
    }
    assert_eq!(removals, 1, "the creation journals one cut to nothing");
    std::fs::write(&jpath, old).unwrap();
    assert_new_volume_served(&crash);
    // once a checkpoint has put its map in place, the volume takes the new
    // rule: its map lost while the journal changes it is damage
    // (resized too: the journal then holds the map's full length)
    let e = Engine::open(&crash, EngineConfig::default()).unwrap();
    e.resize_volume("c", 16 << 20).unwrap();
    let (c, _) = e.volume("c").unwrap();
    e.write(c, 4096, &pattern(8), true).unwrap();
    let again = d.path().join("again");
    crash_copy(&crash, &again);
    drop(e);
    std::fs::remove_file(again.join("maps").join(c.0.to_string())).unwrap();
    let e = Engine::open(&again, EngineConfig::default()).unwrap();
    assert!(e.volume_read_only(c), "a lost map read as holes");
}

#[test]
fn deleting_a_volume_with_a_lost_map_says_its_blocks_wait_for_a_repair() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    std::fs::remove_file(first_map_file(&path)).unwrap();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    assert!(e.delete_volume("a").unwrap().map_damaged);
    assert!(!e.delete_volume("b").unwrap().map_damaged);
    e.close().unwrap();
    drop(e);
    // a's references were never released: its 600 blocks (b's 100
    // among them) stay referenced by no LBA, leaked
    let check = fsck(&path, FsckOptions::default()).unwrap();
    assert_eq!(check.leaked_blocks, 600, "{check:?}");
    assert_eq!(repair(&path), 1);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 0);
}

/// Every block of volumes `a` (600), `b` (100) and `c` (pattern 7 at
/// block 0) of `store`, opened with 8 KiB of map cache so that pages are
/// read back from their files, after a checkpoint has put the journal's
/// pages in place.
fn assert_paged_back_after_checkpoint(store: &Path, with_c: bool, a_blocks: u64) {
    let config = EngineConfig {
        map_cache_bytes: 8 << 10,
        reverse_index_cache_bytes: 8 << 10,
        ..EngineConfig::default()
    };
    let e = Engine::open(store, config).unwrap();
    e.checkpoint().unwrap();
    let mut buf = vec![0u8; 4096];
    for _ in 0..2 {
        for (name, blocks) in [("a", a_blocks), ("b", 100)] {
            let (id, _) = e.volume(name).unwrap();
            for i in 0..blocks {
                e.read(id, i * 4096, &mut buf).unwrap();
                assert!(buf == pattern(i), "volume {name} block {i} differs");
            }
        }
        if with_c {
            let (c, _) = e.volume("c").unwrap();
            e.read(c, 0, &mut buf).unwrap();
            assert!(buf == pattern(7), "volume c block 0 differs");
        }
    }
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn files_made_anew_are_paged_from_after_the_checkpoint_that_writes_them() {
    // a volume created since the last checkpoint, after a crash
    let d = tempfile::tempdir().unwrap();
    let crash = crash_image_with_a_new_volume(d.path());
    assert_paged_back_after_checkpoint(&crash, true, 600);
    // reference counts, reverse index and a map repaired, after a crash
    // before the repair's checkpoint
    for name in ["maps/1", "refcounts", "fingerprints"] {
        let d = tempfile::tempdir().unwrap();
        let crash = crash_image_of_a_repair(d.path(), name);
        let a_blocks = if name.starts_with("maps") { 0 } else { 600 };
        assert_paged_back_after_checkpoint(&crash, false, a_blocks);
    }
}

#[test]
fn reference_counts_zeroed_in_place_are_refused_and_repaired() {
    // A page of zeros passes as a hole (files grow sparsely), so no
    // checksum sees reference counts zeroed or cut short; served, the
    // blocks they count would be free for the next writes to overwrite.
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let rc = path.join("refcounts");
    let len = std::fs::metadata(&rc).unwrap().len();
    std::fs::write(&rc, vec![0u8; len as usize]).unwrap();
    match Engine::open(&path, EngineConfig::default()) {
        Err(EngineError::Corrupt { file, detail }) => {
            assert!(file.ends_with("refcounts"), "{file:?}");
            assert!(detail.contains("fsck --repair"), "{detail}");
            assert!(!detail.contains("  "), "{detail}");
        }
        other => panic!("{:?}", other.err()),
    }
    let check = fsck(&path, FsckOptions::default()).unwrap();
    assert_ne!(check.exit_code(), 0);
    let fixed = fsck_repair(&path);
    assert_eq!(fixed.exit_code(), 1);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    assert!(e.notes().is_empty(), "{:?}", e.notes());
    let (a, _) = e.volume("a").unwrap();
    let (b, _) = e.volume("b").unwrap();
    // new writes take free blocks, not the ones the maps hold
    e.write(b, 200 * 4096, &vec![0xee; 64 * 4096], false)
        .unwrap();
    let mut back = vec![0u8; 4096];
    for i in 0..600 {
        e.read(a, i * 4096, &mut back).unwrap();
        assert_eq!(back, pattern(i), "block {i} of a");
    }
    assert!(e.check().is_empty());
}

#[test]
fn a_map_page_zeroed_in_place_is_reported_as_held_blocks() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    {
        use std::os::unix::fs::FileExt;
        let map = std::fs::OpenOptions::new()
            .write(true)
            .open(first_map_file(&path))
            .unwrap();
        map.write_all_at(&[0u8; 4096], 0).unwrap();
    }
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    assert!(e.damage().is_empty());
    assert!(
        e.notes().iter().any(|n| n.contains("fsck --repair")),
        "{:?}",
        e.notes()
    );
}

/// More scattered LBAs past the data file's end than runs are listed: the
/// first runs are named, the rest summed up in one line for the volume,
/// and the counts say which are which.
#[test]
fn lbas_past_the_listed_runs_are_summed_up_per_volume() {
    use dedupd_engine::fsck::NAMED_PROBLEMS_MAX;
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("store");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let n = NAMED_PROBLEMS_MAX as u64 + 7;
    let a = e.create_volume("a", 2 * n * 4096).unwrap();
    // every other LBA: one run each
    for i in 0..n {
        e.write(a, 2 * i * 4096, &pattern(i), false).unwrap();
    }
    e.close().unwrap();
    drop(e);
    let data = std::fs::OpenOptions::new()
        .write(true)
        .open(path.join("data"))
        .unwrap();
    data.set_len(0).unwrap();
    drop(data);
    let check = fsck(&path, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 4);
    assert_eq!(check.lbas_outside_data_file, n);
    assert_eq!(check.lbas_not_listed, 7);
    assert!(
        check
            .data_lost
            .contains(&"volume a: 7 more LBAs unmapped (their blocks are missing)".to_string()),
        "{:?}",
        &check.data_lost[check.data_lost.len() - 3..]
    );
    assert!(check
        .problems
        .contains(&"volume a: 7 more LBAs map past the end of the data file".to_string()));
    // (the PBAs' one run line came after the list was full: counted)
    assert_eq!(check.problems_not_listed, 1);
    assert_eq!(
        check.problems.last().unwrap(),
        "... and 1 more problems not listed"
    );
    assert_eq!(check.data_lost_not_listed, 0);
    // lines: the listed runs, the summary, the counted one
    assert_eq!(check.problem_count(), NAMED_PROBLEMS_MAX as u64 + 2);
    let fixed = fsck_repair(&path);
    assert_eq!(fixed.exit_code(), 1, "{:?}", fixed.problems.last());
    assert_eq!(fsck(&path, FsckOptions::default()).unwrap().exit_code(), 0);
}

/// Counters of writes that change no mapping (zeros over holes, the same
/// bytes again, a TRIM of nothing) are committed by a FLUSH like any
/// other change, so a crash after it keeps them.
#[test]
fn counters_of_writes_that_change_no_mapping_survive_a_crash_after_flush() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (b, _) = e.volume("b").unwrap();
    let before = e.stats();
    e.write(b, 400 * 4096, &vec![0u8; 4 * 4096], false).unwrap();
    e.write(b, 0, &pattern(0), false).unwrap(); // what LBA 0 holds already
    e.trim(b, 500 * 4096, 8 * 4096, false).unwrap();
    e.flush().unwrap();
    let flushed = e.stats();
    assert_eq!(flushed.blocks_written, before.blocks_written + 5);
    assert_eq!(flushed.zero_blocks_written, before.zero_blocks_written + 4);
    assert_eq!(flushed.blocks_trimmed, before.blocks_trimmed + 8);
    let crash = d.path().join("crash");
    crash_copy(&path, &crash);
    drop(e);
    let e = Engine::open(&crash, EngineConfig::default()).unwrap();
    let after = e.stats();
    assert_eq!(
        (
            after.blocks_written,
            after.zero_blocks_written,
            after.duplicate_writes_eliminated,
            after.blocks_trimmed
        ),
        (
            flushed.blocks_written,
            flushed.zero_blocks_written,
            flushed.duplicate_writes_eliminated,
            flushed.blocks_trimmed
        )
    );
}

/// The transactions of the chain before a checkpoint's reset stay in the
/// journal past the new chain, with lower numbers: no note of a cut
/// transaction for them (only the next number counts).
#[test]
fn stale_transactions_past_a_reset_chain_are_no_cut_commit() {
    let d = tempfile::tempdir().unwrap();
    let path = build(d.path());
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (b, _) = e.volume("b").unwrap();
    for i in 0..4u64 {
        e.write(b, (300 + i) * 4096, &pattern(40 + i), true)
            .unwrap();
    }
    e.checkpoint().unwrap();
    e.write(b, 310 * 4096, &pattern(50), true).unwrap();
    let crash = d.path().join("crash");
    crash_copy(&path, &crash);
    drop(e);
    let e = Engine::open(&crash, EngineConfig::default()).unwrap();
    assert!(e.notes().is_empty(), "{:?}", e.notes());
    let (b, _) = e.volume("b").unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(b, 310 * 4096, &mut buf).unwrap();
    assert!(buf == pattern(50));
}

/// A store where volume `b` held patterns 0..4 (committed), then TRIM of
/// `b` and a write to `a` were committed, then `after` ran and the engine
/// stopped without closing (a crash): returns (store, journal offset of
/// that last transaction, its end).
fn store_with_a_committed_release(dir: &Path, after: impl FnOnce(&Engine)) -> (PathBuf, u64, u64) {
    let path = dir.join("store");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let a = e.create_volume("a", 8 << 20).unwrap();
    let b = e.create_volume("b", 8 << 20).unwrap();
    let x: Vec<u8> = (0..4).flat_map(pattern).collect();
    e.write(b, 0, &x, false).unwrap();
    e.flush().unwrap();
    let start = e.stats().journal_bytes;
    e.trim(b, 0, 4 * 4096, false).unwrap();
    e.write(a, 0, &pattern(100), false).unwrap();
    e.flush().unwrap();
    let end = e.stats().journal_bytes;
    after(&e);
    e.drop_without_closing();
    (path, start, end)
}

/// New content written to volume `a`, not flushed.
fn write_unflushed(e: &Engine) {
    let (a, _) = e.volume("a").unwrap();
    let y: Vec<u8> = (200..208).flat_map(pattern).collect();
    e.write(a, 1 << 20, &y, false).unwrap();
}

/// Volume `b` reads patterns 0..4 or zeros, block by block (never another
/// block's data).
fn b_reads_its_own_or_zeros(e: &Engine) {
    let (b, _) = e.volume("b").unwrap();
    let mut got = vec![0u8; 4096];
    for i in 0..4u64 {
        e.read(b, i * 4096, &mut got).unwrap();
        assert!(
            got == pattern(i) || got.iter().all(|&x| x == 0),
            "LBA {i} of b reads another block's data"
        );
    }
}

#[test]
fn blocks_released_by_the_last_commit_are_not_reused_before_another_is_durable() {
    // the last transaction released b's blocks; writes after it, never
    // flushed, must not take them: were that transaction damaged after
    // its commit, recovery stops before it, where b maps them again
    let dir = tempfile::tempdir().unwrap();
    let (path, start, end) = store_with_a_committed_release(dir.path(), write_unflushed);
    // bit rot in the body of the last transaction
    flip(&path.join("journal"), start + (end - start) / 2);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    b_reads_its_own_or_zeros(&e);
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn after_a_replay_a_write_commits_before_it_reuses_what_the_last_transaction_released() {
    let dir = tempfile::tempdir().unwrap();
    let (path, start, end) = store_with_a_committed_release(dir.path(), |_| {});
    // a restart replays the chain; new content is written to a and the
    // server crashes before any flush
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    write_unflushed(&e);
    e.drop_without_closing();
    // bit rot in the body of the transaction that released b's blocks
    flip(&path.join("journal"), start + (end - start) / 2);
    match Engine::open(&path, EngineConfig::default()) {
        // found: an intact transaction follows it
        Err(EngineError::Corrupt { .. }) => {}
        Ok(e) => b_reads_its_own_or_zeros(&e),
        Err(other) => panic!("{other}"),
    }
}
