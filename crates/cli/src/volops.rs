//! Volume resize and delete as both the command line (store opened
//! directly) and the server (control socket) carry them out: a shrink must
//! be asked for (`--shrink`), and while the volume is served neither runs
//! with NBD connections to it open, unless forced (`--force`).

use anyhow::bail;
use dedupd_engine::Engine;
use serde_json::Value;

use crate::exports::VolumeExports;
use crate::size::human;

/// Resizes volume `name` to `size_bytes`. A smaller size needs `shrink` or
/// `force`; with `exports` (a running server), a shrink also needs the
/// volume to have no NBD connection open, or `force`.
///
/// Errors: a shrink not asked for, connections open, the engine's errors.
pub fn resize(
    engine: &Engine,
    exports: Option<&VolumeExports>,
    name: &str,
    size_bytes: u64,
    shrink: bool,
    force: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> anyhow::Result<()> {
    let shrinking = match engine.volume(name) {
        Some((_, old)) if size_bytes < old => {
            if !(shrink || force) {
                let lost = old - size_bytes;
                bail!(
                    "resizing volume {name} from {} to {} would discard its last {lost} bytes \
                     ({}) and whatever data they hold; pass --shrink to do so",
                    human(old),
                    human(size_bytes),
                    human(lost)
                );
            }
            true
        }
        _ => false,
    };
    let _held = match exports {
        Some(x) if shrinking => Some(x.hold(name, force)?),
        _ => None,
    };
    engine.resize_volume_with_progress(name, size_bytes, progress)?;
    Ok(())
}

/// Deletes volume `name`; with `exports` (a running server), only if it has
/// no NBD connection open, or `force`. The engine's report as JSON.
///
/// Errors: connections open, the engine's errors.
pub fn delete(
    engine: &Engine,
    exports: Option<&VolumeExports>,
    name: &str,
    force: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> anyhow::Result<Value> {
    let _held = exports.map(|x| x.hold(name, force)).transpose()?;
    Ok(serde_json::to_value(
        engine.delete_volume_with_progress(name, progress)?,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupd_engine::HashAlgorithm;
    use dedupd_nbd::ExportProvider;
    use std::sync::Arc;

    #[test]
    fn a_shrink_needs_to_be_asked_for() {
        let engine = Engine::in_memory(HashAlgorithm::Sha256);
        engine.create_volume("v", 1 << 20).unwrap();
        let e = resize(&engine, None, "v", 1 << 19, false, false, &mut |_, _| {}).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("524288 bytes") && msg.contains("--shrink"),
            "{msg}"
        );
        assert_eq!(engine.volume("v").unwrap().1, 1 << 20);
        // growing needs nothing; shrinking with --shrink or --force goes
        resize(&engine, None, "v", 1 << 21, false, false, &mut |_, _| {}).unwrap();
        resize(&engine, None, "v", 1 << 20, true, false, &mut |_, _| {}).unwrap();
        resize(&engine, None, "v", 1 << 19, false, true, &mut |_, _| {}).unwrap();
        assert_eq!(engine.volume("v").unwrap().1, 1 << 19);
    }

    #[test]
    fn open_connections_stop_a_delete_or_shrink_unless_forced() {
        let engine = Arc::new(Engine::in_memory(HashAlgorithm::Sha256));
        engine.create_volume("v", 1 << 20).unwrap();
        engine.create_volume("w", 1 << 20).unwrap();
        let exports = VolumeExports::new(engine.clone());
        let a = exports.open("v").unwrap();
        let b = exports.open("v").unwrap();
        assert_eq!(exports.connections("v"), 2);
        let none = &mut |_, _| {};
        let e = delete(&engine, Some(&exports), "v", false, none).unwrap_err();
        assert_eq!(
            e.to_string(),
            "volume v has 2 NBD connections open; disconnect them or pass --force"
        );
        let e = resize(&engine, Some(&exports), "v", 1 << 19, true, false, none).unwrap_err();
        assert!(e.to_string().contains("2 NBD connections"), "{e}");
        // growing is no danger to the clients
        resize(&engine, Some(&exports), "v", 1 << 21, false, false, none).unwrap();
        // other volumes are not concerned
        delete(&engine, Some(&exports), "w", false, none).unwrap();
        drop(a);
        let e = delete(&engine, Some(&exports), "v", false, none).unwrap_err();
        assert!(
            e.to_string()
                .contains("has 1 NBD connection open; disconnect it"),
            "{e}"
        );
        drop(b);
        assert_eq!(exports.connections("v"), 0);
        resize(&engine, Some(&exports), "v", 1 << 20, true, false, none).unwrap();
        let c = exports.open("v").unwrap();
        delete(&engine, Some(&exports), "v", true, none).unwrap();
        assert!(engine.volume("v").is_none());
        drop(c);
    }

    #[test]
    fn a_volume_held_for_a_delete_is_not_opened() {
        let engine = Arc::new(Engine::in_memory(HashAlgorithm::Sha256));
        engine.create_volume("v", 1 << 20).unwrap();
        let exports = VolumeExports::new(engine.clone());
        let held = exports.hold("v", false).unwrap();
        assert!(exports.open("v").is_none());
        drop(held);
        assert!(exports.open("v").is_some());
        // (dropped at once: not counted any more)
        assert_eq!(exports.connections("v"), 0);
    }
}
