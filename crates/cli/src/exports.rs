//! Volumes of the engine as NBD exports, and the count of NBD
//! connections each volume has open (a delete or shrink is refused while
//! there are any, unless forced).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use dedupd_engine::{Engine, EngineError, VolumeId};
use dedupd_nbd::{Export, ExportError, ExportInfo, ExportProvider};

/// Every volume of an engine, exported under its name; the empty name is
/// the volume `default` (no other: a client reconnecting by the empty name
/// after `default` was deleted must not land on another volume).
///
/// Counts the export handles open per volume: the NBD server holds one for
/// each connection in transmission, from the handshake's `GO` or
/// `EXPORT_NAME` until the connection ends (an `INFO` holds one only while
/// it is answered).
pub struct VolumeExports {
    engine: Arc<Engine>,
    users: Arc<Users>,
}

/// Export handles open per volume, and the volumes a delete or shrink is
/// working on (not opened meanwhile).
#[derive(Default)]
struct Users {
    state: Mutex<UsersState>,
}

#[derive(Default)]
struct UsersState {
    /// Open handles per volume (volumes with none are absent).
    open: HashMap<VolumeId, usize>,
    /// Deletes and shrinks running per volume.
    held: HashMap<VolumeId, usize>,
}

impl Users {
    fn lock(&self) -> MutexGuard<'_, UsersState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A volume held for a delete or a shrink: no connection opens it until
/// this is dropped.
pub struct Held {
    users: Arc<Users>,
    id: Option<VolumeId>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        let mut st = self.users.lock();
        if let Some(n) = st.held.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                st.held.remove(&id);
            }
        }
    }
}

impl VolumeExports {
    /// Exports the volumes of `engine`.
    pub fn new(engine: Arc<Engine>) -> Self {
        VolumeExports {
            engine,
            users: Arc::default(),
        }
    }

    /// NBD connections open to the volume `name` (0 if there is no such
    /// volume).
    #[cfg(test)]
    pub fn connections(&self, name: &str) -> usize {
        let Some((id, _)) = self.engine.volume(name) else {
            return 0;
        };
        self.users.lock().open.get(&id).copied().unwrap_or(0)
    }

    /// Holds the volume `name` for an operation that takes its data away
    /// (`what`: "delete", "shrink"): refused while NBD connections to it
    /// are open, unless `force`; while the returned [`Held`] lives, no new
    /// connection opens the volume. A volume that does not exist is not
    /// held (the operation itself reports it).
    ///
    /// Errors: the volume has connections open and `force` is false.
    pub fn hold(&self, name: &str, force: bool) -> anyhow::Result<Held> {
        // (looked up under the lock, as `open` does, so that neither sees
        // the volume as it was before the other)
        let mut st = self.users.lock();
        let Some((id, _)) = self.engine.volume(name) else {
            return Ok(Held {
                users: self.users.clone(),
                id: None,
            });
        };
        let open = st.open.get(&id).copied().unwrap_or(0);
        if open > 0 && !force {
            anyhow::bail!(
                "volume {name} has {open} NBD connection{} open; disconnect {} or pass --force",
                if open == 1 { "" } else { "s" },
                if open == 1 { "it" } else { "them" },
            );
        }
        *st.held.entry(id).or_insert(0) += 1;
        Ok(Held {
            users: self.users.clone(),
            id: Some(id),
        })
    }
}

impl VolumeExports {
    /// The volume name a client's export name stands for: the name
    /// itself, or `default` for the empty name.
    fn resolve(&self, name: &str) -> Option<String> {
        Some(if name.is_empty() { "default" } else { name }.to_string())
    }
}

impl ExportProvider for VolumeExports {
    fn list(&self) -> Vec<ExportInfo> {
        self.engine
            .volume_names()
            .into_iter()
            .map(|(name, size_bytes)| ExportInfo {
                description: format!("dedupd volume, {size_bytes} bytes"),
                name,
            })
            .collect()
    }

    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        let name = self.resolve(name)?;
        let (id, size_bytes) = {
            let mut st = self.users.lock();
            // under the lock: a delete or shrink held and done between the
            // lookup and the count would have passed this connection by
            // (its size the one before the shrink)
            let (id, size_bytes) = self.engine.volume(&name)?;
            // a volume being deleted or shrunk is not opened meanwhile
            if st.held.contains_key(&id) {
                return None;
            }
            *st.open.entry(id).or_insert(0) += 1;
            (id, size_bytes)
        };
        Some(Arc::new(VolumeExport {
            engine: self.engine.clone(),
            id,
            size_bytes,
            users: self.users.clone(),
        }))
    }

    fn canonical_name(&self, name: &str) -> String {
        self.resolve(name).unwrap_or_else(|| name.to_string())
    }

    fn flush_covers_all_connections(&self) -> bool {
        // Engine::flush commits every completed write of the whole store.
        true
    }
}

/// One volume opened by one connection; counted among the volume's open
/// connections until dropped.
struct VolumeExport {
    engine: Arc<Engine>,
    id: VolumeId,
    size_bytes: u64,
    users: Arc<Users>,
}

impl Drop for VolumeExport {
    fn drop(&mut self) {
        let mut st = self.users.lock();
        if let Some(n) = st.open.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                st.open.remove(&self.id);
            }
        }
    }
}

/// [`to_export_error`] for a WRITE or WRITE_ZEROES: past the end (the
/// volume was shrunk while the connection was open) is `ENOSPC`, as the
/// spec asks of writes past the export's end.
fn to_write_error(e: EngineError) -> ExportError {
    match e {
        EngineError::OutOfRange { .. } => ExportError::NoSpace,
        other => to_export_error(other),
    }
}

fn to_export_error(e: EngineError) -> ExportError {
    match e {
        EngineError::NoSpace { .. } => ExportError::NoSpace,
        EngineError::ReadOnly { .. } | EngineError::VolumeDeleting(_) => ExportError::ReadOnly,
        EngineError::OutOfRange { .. }
        | EngineError::InvalidArgument(_)
        | EngineError::NoSuchVolume(_) => ExportError::Invalid(e.to_string()),
        // (said once at start, with the damage: not a line per read, which
        // a client's probes and retries would repeat without end)
        EngineError::MappingLost { .. } => ExportError::Io(e.to_string()),
        other => {
            {
                // (a terminal that hung up: the line is dropped, the
                // request answered all the same)
                use std::io::Write as _;
                let _ = writeln!(std::io::stderr(), "dedupd: I/O error: {other}");
            }
            ExportError::Io(other.to_string())
        }
    }
}

impl Export for VolumeExport {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
    fn read_only(&self) -> bool {
        self.engine.volume_read_only(self.id)
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.engine
            .read(self.id, offset, buf)
            .map_err(to_export_error)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.engine
            .write(self.id, offset, data, fua)
            .map_err(to_write_error)
    }
    fn flush(&self) -> Result<(), ExportError> {
        self.engine.flush().map_err(to_export_error)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        self.engine
            .trim(self.id, offset, len, fua)
            .map_err(to_export_error)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        self.engine
            .write_zeroes(self.id, offset, len, fua)
            .map_err(to_write_error)
    }
    fn writes_may_wait_for_disk(&self) -> bool {
        self.engine.commit_due()
    }
    /// Whole blocks: zeroing them only unmaps them (zero blocks are never
    /// stored); a partial block would be read, changed and written back.
    fn fast_zero_granule(&self) -> Option<u32> {
        Some(dedupd_engine::block::BLOCK_SIZE as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupd_engine::HashAlgorithm;

    #[test]
    fn writes_past_a_volume_shrunk_under_a_connection_get_enospc() {
        let engine = Arc::new(Engine::in_memory(HashAlgorithm::Sha256));
        engine.create_volume("v", 1 << 20).unwrap();
        let exports = VolumeExports::new(Arc::clone(&engine));
        let export = exports.open("v").unwrap();
        assert_eq!(export.size_bytes(), 1 << 20);
        engine.resize_volume("v", 1 << 19).unwrap();
        let block = vec![1u8; 4096];
        let past = 600 * 1024;
        assert!(matches!(
            export.write(past, &block, false),
            Err(ExportError::NoSpace)
        ));
        assert!(matches!(
            export.write_zeroes(past, 4096, false),
            Err(ExportError::NoSpace)
        ));
        let mut buf = vec![0u8; 4096];
        assert!(matches!(
            export.read(past, &mut buf),
            Err(ExportError::Invalid(_))
        ));
        export.write(0, &block, false).unwrap();
    }
}
