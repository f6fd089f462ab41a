//! Shared test fixtures: a memory-backed export, a provider, a running
//! server and a small hand-written NBD client.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use dedupd_nbd::proto;
use dedupd_nbd::{
    Export, ExportError, ExportInfo, ExportProvider, Server, ServerConfig, ShutdownHandle,
};

/// A `Vec<u8>` behind a mutex, optionally read-only, optionally slow.
pub struct MemExport {
    pub data: Mutex<Vec<u8>>,
    pub read_only: bool,
    pub delay: Duration,
    pub flushes: Mutex<u64>,
    /// Says its writes may wait for the disk (they sleep `delay`).
    pub writes_wait: bool,
}

impl MemExport {
    pub fn new(size: usize, read_only: bool) -> Arc<MemExport> {
        Arc::new(MemExport {
            data: Mutex::new(vec![0u8; size]),
            read_only,
            delay: Duration::ZERO,
            flushes: Mutex::new(0),
            writes_wait: false,
        })
    }

    pub fn slow(size: usize, delay: Duration) -> Arc<MemExport> {
        Arc::new(MemExport {
            data: Mutex::new(vec![0u8; size]),
            read_only: false,
            delay,
            flushes: Mutex::new(0),
            writes_wait: delay >= Duration::from_secs(1),
        })
    }

    fn pause(&self) {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
    }
}

impl Export for MemExport {
    fn size_bytes(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.pause();
        let d = self.data.lock().unwrap();
        let o = offset as usize;
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), ExportError> {
        self.pause();
        let mut d = self.data.lock().unwrap();
        let o = offset as usize;
        d[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> Result<(), ExportError> {
        *self.flushes.lock().unwrap() += 1;
        Ok(())
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        self.write_zeroes(offset, len, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, _fua: bool) -> Result<(), ExportError> {
        self.pause();
        let mut d = self.data.lock().unwrap();
        d[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
    fn writes_may_wait_for_disk(&self) -> bool {
        self.writes_wait
    }
}

/// Exports: "disk" (default, 8 MiB), "ro" (read-only, 1 MiB), "slow"
/// (1 MiB, every I/O sleeps 300 ms), "stall" (1 MiB, every I/O sleeps
/// 3 s; it says its writes may wait for the disk), "full" (every request fails), "null" (1 GiB, no storage).
pub struct Provider {
    pub disk: Arc<MemExport>,
    pub ro: Arc<MemExport>,
    pub slow: Arc<MemExport>,
    pub stall: Arc<MemExport>,
    pub null: Arc<Null>,
}

pub const DISK_SIZE: usize = 8 * 1024 * 1024;

impl Provider {
    pub fn new() -> Arc<Provider> {
        Arc::new(Provider {
            disk: MemExport::new(DISK_SIZE, false),
            ro: MemExport::new(1024 * 1024, true),
            slow: MemExport::slow(1024 * 1024, Duration::from_millis(300)),
            stall: MemExport::slow(1024 * 1024, Duration::from_secs(3)),
            null: Arc::new(Null {
                longest_trim: Mutex::new(0),
                longest_zero: Mutex::new(0),
            }),
        })
    }
}

/// 1 GiB that reads as zeros and drops writes; counts the longest TRIM and
/// WRITE_ZEROES it was asked for.
pub struct Null {
    pub longest_trim: Mutex<u64>,
    pub longest_zero: Mutex<u64>,
}

pub const NULL_SIZE: u64 = 1 << 30;

impl Export for Null {
    fn size_bytes(&self) -> u64 {
        NULL_SIZE
    }
    fn read(&self, _: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        buf.fill(0);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ExportError> {
        Ok(())
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
    fn trim(&self, _: u64, len: u64, _: bool) -> Result<(), ExportError> {
        let mut l = self.longest_trim.lock().unwrap();
        *l = (*l).max(len);
        Ok(())
    }
    fn write_zeroes(&self, _: u64, len: u64, _: bool) -> Result<(), ExportError> {
        let mut l = self.longest_zero.lock().unwrap();
        *l = (*l).max(len);
        Ok(())
    }
}

struct Full;

impl Export for Full {
    fn size_bytes(&self) -> u64 {
        1 << 20
    }
    fn read(&self, _: u64, _: &mut [u8]) -> Result<(), ExportError> {
        Err(ExportError::Io("broken".into()))
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ExportError> {
        Err(ExportError::NoSpace)
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), ExportError> {
        Err(ExportError::Invalid("no".into()))
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool) -> Result<(), ExportError> {
        Err(ExportError::ReadOnly)
    }
}

impl ExportProvider for Provider {
    fn list(&self) -> Vec<ExportInfo> {
        vec![
            ExportInfo {
                name: "disk".into(),
                description: "memory disk".into(),
            },
            ExportInfo {
                name: "ro".into(),
                description: "read-only disk".into(),
            },
        ]
    }
    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        match name {
            "" | "disk" => Some(self.disk.clone()),
            "ro" => Some(self.ro.clone()),
            "slow" => Some(self.slow.clone()),
            "stall" => Some(self.stall.clone()),
            "full" => Some(Arc::new(Full)),
            "null" => Some(self.null.clone()),
            _ => None,
        }
    }
    fn canonical_name(&self, name: &str) -> String {
        if name.is_empty() { "disk" } else { name }.to_string()
    }
    fn flush_covers_all_connections(&self) -> bool {
        true
    }
}

/// A server running on 127.0.0.1:0 and on a Unix socket in a temp dir.
pub struct Harness {
    pub server: Arc<Server>,
    pub provider: Arc<Provider>,
    pub addr: SocketAddr,
    pub socket_path: PathBuf,
    pub shutdown: ShutdownHandle,
    threads: Vec<JoinHandle<std::io::Result<()>>>,
    _dir: tempfile::TempDir,
}

impl Harness {
    pub fn start(config: ServerConfig) -> Harness {
        let provider = Provider::new();
        let server = Arc::new(Server::new(provider.clone(), config));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket_path = dir.path().join("nbd.sock");
        let unix = UnixListener::bind(&socket_path).unwrap();
        let s1 = server.clone();
        let s2 = server.clone();
        let threads = vec![
            std::thread::spawn(move || s1.serve_tcp(listener)),
            std::thread::spawn(move || s2.serve_unix(unix)),
        ];
        Harness {
            shutdown: server.shutdown_handle(),
            server,
            provider,
            addr,
            socket_path,
            threads,
            _dir: dir,
        }
    }

    pub fn tcp(&self) -> Client<TcpStream> {
        let s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Client { s }
    }

    pub fn unix(&self) -> Client<UnixStream> {
        let s = UnixStream::connect(&self.socket_path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Client { s }
    }

    /// Shuts the server down and waits for both serve_* calls.
    pub fn stop(mut self) {
        self.shutdown.shutdown();
        for t in self.threads.drain(..) {
            t.join().unwrap().unwrap();
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.shutdown();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One option reply.
#[derive(Debug)]
pub struct OptReply {
    pub option: u32,
    pub kind: u32,
    pub data: Vec<u8>,
}

/// The bytes of one request: header, then `payload`.
pub fn request_bytes(
    flags: u16,
    cmd: u16,
    handle: u64,
    offset: u64,
    len: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut b = proto::encode_request(flags, cmd, handle, offset, len).to_vec();
    b.extend_from_slice(payload);
    b
}

/// A minimal NBD client speaking fixed newstyle and simple replies.
pub struct Client<S: Read + Write> {
    pub s: S,
}

impl<S: Read + Write> Client<S> {
    pub fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.s.read_exact(&mut b).unwrap();
        b
    }

    /// True if the server closed the connection (EOF or reset), false if
    /// it sent a byte; panics if neither happens within the client's read
    /// timeout (20 s), so a server that keeps the connection open fails
    /// the test instead of passing it.
    pub fn at_eof(&mut self) -> bool {
        use std::io::ErrorKind;
        let mut b = [0u8; 1];
        match self.s.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                true
            }
            Err(e) => panic!("the server neither closed the connection nor sent a byte: {e}"),
        }
    }

    /// Reads the greeting and sends `client_flags`.
    pub fn greet(&mut self, client_flags: u32) {
        let g = self.read_n(18);
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(u16::from_be_bytes([g[16], g[17]]), 3);
        self.s.write_all(&client_flags.to_be_bytes()).unwrap();
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut b = proto::IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).unwrap();
    }

    /// Sends an option's header announcing `len` bytes of data, and none.
    pub fn send_option_header(&mut self, option: u32, len: u32) {
        let mut b = proto::IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        self.s.write_all(&b).unwrap();
    }

    pub fn option_reply(&mut self) -> OptReply {
        let h = self.read_n(20);
        assert_eq!(&h[0..8], &proto::OPTION_REPLY_MAGIC.to_be_bytes());
        let option = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let data = self.read_n(len);
        OptReply { option, kind, data }
    }

    pub fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    /// Sends INFO or GO; returns the NBD_REP_INFO payloads and the final reply.
    pub fn info_or_go(
        &mut self,
        option: u32,
        name: &str,
        infos: &[u16],
    ) -> (Vec<Vec<u8>>, OptReply) {
        self.send_option(option, &Self::info_data(name, infos));
        let mut got = Vec::new();
        loop {
            let r = self.option_reply();
            assert_eq!(r.option, option);
            if r.kind == proto::REP_INFO {
                got.push(r.data);
            } else {
                return (got, r);
            }
        }
    }

    /// Full handshake with GO; returns (size, transmission flags).
    pub fn connect_go(&mut self, name: &str) -> (u64, u16) {
        self.greet(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES);
        let (infos, fin) = self.info_or_go(proto::OPT_GO, name, &[proto::INFO_BLOCK_SIZE]);
        assert_eq!(fin.kind, proto::REP_ACK, "GO failed: {fin:?}");
        let export = infos
            .iter()
            .find(|i| i[0..2] == proto::INFO_EXPORT.to_be_bytes())
            .expect("NBD_INFO_EXPORT");
        let size = u64::from_be_bytes(export[2..10].try_into().unwrap());
        let flags = u16::from_be_bytes(export[10..12].try_into().unwrap());
        (size, flags)
    }

    pub fn send_request(
        &mut self,
        flags: u16,
        cmd: u16,
        handle: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) {
        self.s
            .write_all(&request_bytes(flags, cmd, handle, offset, len, payload))
            .unwrap();
    }

    /// Reads a simple reply header: (error, handle).
    pub fn reply(&mut self) -> (u32, u64) {
        let h = self.read_n(16);
        assert_eq!(&h[0..4], &proto::SIMPLE_REPLY_MAGIC.to_be_bytes());
        (
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        )
    }

    /// One request, one reply (no data); returns the error.
    pub fn simple(&mut self, flags: u16, cmd: u16, offset: u64, len: u32, payload: &[u8]) -> u32 {
        self.send_request(flags, cmd, 77, offset, len, payload);
        let (err, handle) = self.reply();
        assert_eq!(handle, 77);
        err
    }

    pub fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        self.send_request(0, proto::CMD_READ, 5, offset, len, &[]);
        let (err, handle) = self.reply();
        assert_eq!(handle, 5);
        if err == 0 {
            Ok(self.read_n(len as usize))
        } else {
            Err(err)
        }
    }
}
