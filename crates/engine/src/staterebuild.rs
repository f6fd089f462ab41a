//! The volume table rebuilt when `state.json` is damaged (for
//! `dedupd fsck`, which then writes it anew with `--repair`).
//!
//! Each volume has a map file `maps/<id>`, so the volumes are known from
//! the maps directory (and the journal's changes to it); what the damaged
//! file still says is kept where it agrees with them:
//! - a volume whose map exists keeps the name, size and settings the
//!   damaged file gives it if the file still parses, the name is valid
//!   and unused, and the size needs the map's length; otherwise it is
//!   named `volume-<id>` and sized to what its map holds (508 LBAs per
//!   4 KiB map page, so up to 2 MiB more than it had), and not deleting
//!   or shrinking;
//! - a volume the damaged file lists without a map stays, its map then
//!   reported missing as for any volume;
//! - the next volume id passes every id seen.
//!
//! A checksum failure means the bytes changed after they were written, so
//! nothing the file says is trusted blindly: what was kept and what was
//! made up is described for the report, for the user to check.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use crate::engine::{validate_name, validate_size, MAX_VOLUME_BYTES};
use crate::journal::{MetaFile, Op};
use crate::paged::{disk_len, PAGE_SIZE, U64_PER_PAGE};
use crate::store::{State, VolumeRecord};
use crate::VolumeId;

/// The volume table for a store whose `state.json` (`bytes`, after the
/// journal's `chain_ops`) fails its checksum: the state and a description
/// of it for the report (one line per volume, naming what was kept from
/// the damaged file and what was made up).
///
/// Errors: reading the maps directory.
pub fn rebuild_state(
    root: &Path,
    bytes: &[u8],
    chain_ops: &[Op],
) -> std::io::Result<(State, String)> {
    let salvaged = salvage(bytes);
    let map_lens = map_lengths(root, chain_ops)?;
    let mut state = State::default();
    let mut lines = Vec::new();
    let mut names = HashSet::new();
    let mut records: BTreeMap<u32, VolumeRecord> = BTreeMap::new();
    let old: BTreeMap<u32, &VolumeRecord> = salvaged
        .as_ref()
        .map(|s| s.volumes.iter().map(|r| (r.id.0, r)).collect())
        .unwrap_or_default();
    for (&id, &len) in &map_lens {
        let pages = len / PAGE_SIZE as u64;
        let held_bytes = (pages * U64_PER_PAGE * crate::BLOCK_SIZE as u64).min(MAX_VOLUME_BYTES);
        if held_bytes == 0 {
            lines.push(format!("maps/{id} is empty: no volume made for it"));
            continue;
        }
        let kept = old.get(&id).filter(|r| {
            valid(r)
                && disk_len(r.size_bytes / crate::BLOCK_SIZE as u64 * 8) == len
                && !names.contains(&r.name)
        });
        let record = match kept {
            Some(r) => {
                lines.push(format!(
                    "volume {:?} (id {id}, {} bytes): as state.json gave it",
                    r.name, r.size_bytes
                ));
                (*r).clone()
            }
            None => {
                let mut name = format!("volume-{id}");
                while names.contains(&name) {
                    name.push('_');
                }
                lines.push(format!(
                    "volume {name:?} (id {id}, {held_bytes} bytes): name and size made up \
                     from maps/{id} (whether a delete or shrink of it was under way is \
                     not known){}",
                    old.get(&id).map_or(String::new(), |r| format!(
                        " (state.json, unreadable there, says {:?} of {} bytes)",
                        r.name, r.size_bytes
                    ))
                ));
                VolumeRecord {
                    id: VolumeId(id),
                    name,
                    size_bytes: held_bytes,
                    sequence_threshold_blocks: None,
                    deleting: false,
                    shrinking_to_bytes: None,
                    creation_marked: false,
                }
            }
        };
        names.insert(record.name.clone());
        records.insert(id, record);
    }
    // listed without a map: kept (their map is then missing, as any
    // volume's would be reported)
    for (&id, r) in &old {
        if records.contains_key(&id) || !valid(r) || names.contains(&r.name) {
            continue;
        }
        lines.push(format!(
            "volume {:?} (id {id}, {} bytes): as state.json gave it, but it has no map",
            r.name, r.size_bytes
        ));
        names.insert(r.name.clone());
        records.insert(id, (*r).clone());
    }
    let highest = records.keys().max().map_or(0, |&id| id + 1);
    state.next_volume_id = salvaged
        .as_ref()
        .map_or(highest, |s| s.next_volume_id.max(highest));
    if let Some(s) = &salvaged {
        state.default_sequence_threshold_blocks = s.default_sequence_threshold_blocks.max(1);
        state.verify = s.verify;
        // (a format-1 store's counters and journal sequence)
        state.counters = s.counters.clone();
        state.journal_seq = s.journal_seq;
    }
    state.volumes = records.into_values().collect();
    let source = if salvaged.is_some() {
        "rebuilt from the volume maps and the damaged file"
    } else {
        "rebuilt from the volume maps (the damaged file does not parse)"
    };
    let description = if lines.is_empty() {
        format!("volume table {source}: no volumes")
    } else {
        format!("volume table {source}; check each: {}", lines.join("; "))
    };
    Ok((state, description))
}

/// The volume table as the damaged file still gives it, if its text (the
/// checksum line left off) parses.
fn salvage(bytes: &[u8]) -> Option<State> {
    let text = std::str::from_utf8(bytes).ok()?;
    let body = crate::store::split_checked(text).map_or(text, |(body, _)| body);
    serde_json::from_str(body).ok()
}

/// Length in bytes of each volume map (`maps/<id>`), after the journal's
/// changes to it (a map the journal removes is left out).
fn map_lengths(root: &Path, chain_ops: &[Op]) -> std::io::Result<BTreeMap<u32, u64>> {
    let mut lens = BTreeMap::new();
    match std::fs::read_dir(root.join("maps")) {
        Ok(entries) => {
            for entry in entries {
                let entry = entry?;
                let Some(id) = entry
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<u32>().ok())
                else {
                    continue;
                };
                let meta = entry.metadata()?;
                if meta.is_file() {
                    lens.insert(id, meta.len());
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    for op in chain_ops {
        if let MetaFile::Map(id) = op.file() {
            match op {
                Op::SetLen { len_bytes, .. } => {
                    lens.insert(id.0, *len_bytes);
                }
                Op::Remove { .. } => {
                    lens.remove(&id.0);
                }
                Op::Write { offset, data, .. } => {
                    let end = offset + data.len() as u64;
                    let len = lens.entry(id.0).or_insert(0);
                    *len = (*len).max(end);
                }
                Op::Replace { .. } | Op::Patch { .. } => {}
            }
        }
    }
    Ok(lens)
}

/// A name and size `volume create` would take.
fn valid(r: &VolumeRecord) -> bool {
    validate_name(&r.name).is_ok() && validate_size(r.size_bytes).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: u32, name: &str, size_bytes: u64) -> VolumeRecord {
        VolumeRecord {
            id: VolumeId(id),
            name: name.into(),
            size_bytes,
            sequence_threshold_blocks: Some(4),
            deleting: false,
            shrinking_to_bytes: None,
            creation_marked: true,
        }
    }

    fn map_len(size_bytes: u64) -> u64 {
        disk_len(size_bytes / 4096 * 8)
    }

    #[test]
    fn names_and_sizes_that_agree_with_the_maps_are_kept_the_rest_made_up() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("maps")).unwrap();
        let gib = 1u64 << 30;
        for (id, size) in [(0u32, gib), (1, 2 * gib), (5, gib)] {
            let f = std::fs::File::create(dir.path().join(format!("maps/{id}"))).unwrap();
            f.set_len(map_len(size)).unwrap();
        }
        // the damaged file: volume 0 as it is, volume 1 with a flipped
        // size, volume 5 missing, volume 7 without a map
        let old = State {
            next_volume_id: 8,
            volumes: vec![
                record(0, "alpha", gib),
                record(1, "beta", 3 * gib),
                record(7, "gamma", gib),
            ],
            ..State::default()
        };
        let text = format!(
            "{}\ncrc32c=00000000\n",
            serde_json::to_string(&old).unwrap()
        );
        let (s, said) = rebuild_state(dir.path(), text.as_bytes(), &[]).unwrap();
        assert_eq!(s.next_volume_id, 8);
        let got: Vec<(u32, &str, u64)> = s
            .volumes
            .iter()
            .map(|r| (r.id.0, r.name.as_str(), r.size_bytes))
            .collect();
        let held = |size: u64| map_len(size) / 4096 * U64_PER_PAGE * 4096;
        assert_eq!(
            got,
            vec![
                (0, "alpha", gib),
                (1, "volume-1", held(2 * gib)),
                (5, "volume-5", held(gib)),
                (7, "gamma", gib),
            ]
        );
        // a made-up size covers the map: every LBA the volume had
        assert!(held(2 * gib) >= 2 * gib && held(2 * gib) < 2 * gib + (2 << 20));
        assert_eq!(s.volumes[0].sequence_threshold_blocks, Some(4));
        assert!(said.contains("\"beta\" of 3221225472 bytes"), "{said}");
        assert!(said.contains("no map"), "{said}");

        // garbage: everything from the maps, and the journal's changes
        // (a map removed, one grown)
        let ops = [
            Op::Remove {
                file: MetaFile::Map(VolumeId(5)),
            },
            Op::SetLen {
                file: MetaFile::Map(VolumeId(0)),
                len_bytes: map_len(4 * gib),
            },
        ];
        let (s, said) = rebuild_state(dir.path(), b"\x00\x01garbage", &ops).unwrap();
        let got: Vec<(u32, String, u64)> = s
            .volumes
            .iter()
            .map(|r| (r.id.0, r.name.clone(), r.size_bytes))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, "volume-0".to_string(), held(4 * gib)),
                (1, "volume-1".to_string(), held(2 * gib)),
            ]
        );
        assert_eq!(s.next_volume_id, 2);
        assert!(said.contains("does not parse"), "{said}");
    }
}
