//! The control socket `<store>/control.sock`: lets `dedupd stats` and
//! `dedupd volume …` reach a running `dedupd serve`, which holds the store.
//!
//! Protocol: one JSON request line, one JSON reply line.
//! Requests: `{"cmd":"stats"}`, `{"cmd":"volume_list"}`,
//! `{"cmd":"volume_create","name":N,"size_bytes":S}`,
//! `{"cmd":"volume_resize","name":N,"size_bytes":S}`,
//! `{"cmd":"volume_delete","name":N}`,
//! `{"cmd":"volume_set","name":N,"sequence_threshold_blocks":T|null}`,
//! `{"cmd":"dedup_offline","volume":N|null}`.
//! Replies: `{"ok":true,"result":…}` or `{"ok":false,"error":"…"}`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A control request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    /// Engine and server figures.
    Stats,
    /// Every volume.
    VolumeList,
    /// Create a volume.
    VolumeCreate { name: String, size_bytes: u64 },
    /// Resize a volume.
    VolumeResize { name: String, size_bytes: u64 },
    /// Delete a volume.
    VolumeDelete { name: String },
    /// Set a volume's sequence threshold (None: the server's default).
    VolumeSet {
        name: String,
        sequence_threshold_blocks: Option<u32>,
    },
    /// Full out-of-line dedup pass over one volume or all.
    DedupOffline { volume: Option<String> },
}

/// Path of the control socket of the store at `store`.
pub fn socket_path(store: &Path) -> PathBuf {
    store.join("control.sock")
}

/// Sends `req` to the server of `store`; the reply's result or its error.
pub fn call(store: &Path, req: &Request) -> anyhow::Result<Value> {
    let path = socket_path(store);
    let mut s = UnixStream::connect(&path)
        .with_context(|| format!("connecting to the running server at {}", path.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    let mut line = serde_json::to_string(req)?;
    line.push('\n');
    s.write_all(line.as_bytes())?;
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply)?;
    let v: Value = serde_json::from_str(&reply).context("malformed reply from the server")?;
    if v["ok"].as_bool() == Some(true) {
        Ok(v["result"].clone())
    } else {
        Err(anyhow!("{}", v["error"].as_str().unwrap_or("server error")))
    }
}

/// Serves control requests on `listener` until `stop` is set, answering
/// each with `handle`.
pub fn serve(
    listener: UnixListener,
    stop: Arc<AtomicBool>,
    handle: impl Fn(Request) -> anyhow::Result<Value> + Send + Sync + 'static,
) {
    let handle = Arc::new(handle);
    listener.set_nonblocking(true).ok();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let handle = handle.clone();
                std::thread::spawn(move || {
                    let _ = answer(stream, &*handle);
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn answer(
    stream: UnixStream,
    handle: &dyn Fn(Request) -> anyhow::Result<Value>,
) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut line = String::new();
    BufReader::new(stream.try_clone()?).take_line(&mut line)?;
    let reply = match serde_json::from_str::<Request>(&line) {
        Ok(req) => match handle(req) {
            Ok(result) => serde_json::json!({"ok": true, "result": result}),
            Err(e) => serde_json::json!({"ok": false, "error": format!("{e:#}")}),
        },
        Err(e) => serde_json::json!({"ok": false, "error": format!("bad request: {e}")}),
    };
    let mut out = serde_json::to_vec(&reply).unwrap_or_default();
    out.push(b'\n');
    (&stream).write_all(&out)
}

trait TakeLine {
    fn take_line(self, out: &mut String) -> std::io::Result<usize>;
}

impl<R: std::io::Read> TakeLine for BufReader<R> {
    /// Reads one line of at most 64 KiB.
    fn take_line(self, out: &mut String) -> std::io::Result<usize> {
        use std::io::Read;
        BufReader::new(self.take(64 * 1024)).read_line(out)
    }
}
