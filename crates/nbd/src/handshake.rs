//! Fixed newstyle negotiation ("Handshake" section of the spec).
//!
//! Sends the greeting, checks the client flags, then answers options until
//! the client enters transmission (`NBD_OPT_EXPORT_NAME`, `NBD_OPT_GO`),
//! aborts, or breaks the protocol.

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::export::{Export, ExportProvider};
use crate::proto::{self, ProtoError};

/// How a negotiation ended.
pub(crate) enum Outcome {
    /// The client chose `export`; the transmission phase starts.
    Transmission {
        /// The opened export.
        export: Arc<dyn Export>,
    },
    /// The session is over (abort, unknown export on EXPORT_NAME, ...).
    Closed,
}

/// Why a negotiation failed; the connection is then closed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandshakeError {
    /// The socket failed or the client went away.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The client broke the protocol (bad magic, unknown client flags).
    #[error("protocol: {0}")]
    Protocol(#[from] ProtoError),
}

/// Reads and drops `len` bytes from `r` through a small buffer (never
/// allocating `len` bytes).
pub(crate) fn discard<R: Read + ?Sized>(r: &mut R, mut len: u64) -> io::Result<()> {
    let mut scratch = [0u8; 8192];
    while len > 0 {
        let n = usize::try_from(len.min(scratch.len() as u64)).unwrap_or(scratch.len());
        r.read_exact(&mut scratch[..n])?;
        len -= n as u64;
    }
    Ok(())
}

fn reply<W: Write + ?Sized>(
    w: &mut W,
    option: u32,
    reply_type: u32,
    data: &[u8],
) -> io::Result<()> {
    w.write_all(&proto::encode_option_reply(option, reply_type, data))
}

fn known_option(option: u32) -> bool {
    matches!(
        option,
        proto::OPT_EXPORT_NAME
            | proto::OPT_ABORT
            | proto::OPT_LIST
            | proto::OPT_INFO
            | proto::OPT_GO
    )
}

/// Runs the server side of fixed newstyle negotiation.
///
/// `r` and `w` are the two directions of one connection. `max_payload` is
/// the maximum payload size advertised (bytes). `stopping` is the
/// server's shutdown flag: once set, options other than `NBD_OPT_ABORT` are
/// answered `NBD_REP_ERR_SHUTDOWN`. `transmitting` is set before the reply
/// that moves the client to transmission is flushed, so a shutdown from
/// then on treats the connection as transmitting (its requests get
/// `NBD_ESHUTDOWN`) rather than as still negotiating.
pub(crate) fn negotiate<R: Read + ?Sized, W: Write + ?Sized>(
    r: &mut R,
    w: &mut W,
    max_payload: u32,
    provider: &dyn ExportProvider,
    stopping: &AtomicBool,
    transmitting: &AtomicBool,
) -> Result<Outcome, HandshakeError> {
    w.write_all(&proto::encode_greeting())?;
    w.flush()?;

    let mut flags = [0u8; proto::CLIENT_FLAGS_LEN];
    r.read_exact(&mut flags)?;
    let client_flags = proto::decode_client_flags(&flags)?;
    let no_zeroes = client_flags & proto::FLAG_C_NO_ZEROES != 0;

    loop {
        let mut hdr = [0u8; proto::OPTION_HEADER_LEN];
        r.read_exact(&mut hdr)?;
        let hdr = proto::decode_option_header(&hdr)?;
        let option = hdr.option;

        if option == proto::OPT_ABORT {
            // Acknowledged whatever data it carries, which is not read
            // (proto.md: the server SHOULD ignore it; the connection's
            // close drains it). The client may already have gone.
            let _ = reply(w, option, proto::REP_ACK, &[]).and_then(|()| w.flush());
            return Ok(Outcome::Closed);
        }
        if hdr.length > proto::MAX_OPTION_DATA_LEN {
            if option == proto::OPT_EXPORT_NAME {
                // This option cannot be answered with an error.
                return Ok(Outcome::Closed);
            }
            if stopping.load(Ordering::SeqCst) {
                // as any option during a shutdown, without reading its
                // data (up to 4 GiB): the client disconnects on it
                let _ = reply(w, option, proto::REP_ERR_SHUTDOWN, b"server shutting down")
                    .and_then(|()| w.flush());
                return Ok(Outcome::Closed);
            }
            discard(r, u64::from(hdr.length))?;
            let code = if option == proto::OPT_LIST {
                // (LIST takes no data at all: any is invalid, as below)
                proto::REP_ERR_INVALID
            } else if known_option(option) {
                proto::REP_ERR_TOO_BIG
            } else {
                proto::REP_ERR_UNSUP
            };
            reply(w, option, code, b"option data too long")?;
            w.flush()?;
            continue;
        }
        // At most MAX_OPTION_DATA_LEN (8 KiB) bytes.
        let mut data = vec![0u8; hdr.length as usize];
        r.read_exact(&mut data)?;

        if stopping.load(Ordering::SeqCst) {
            if option == proto::OPT_EXPORT_NAME {
                return Ok(Outcome::Closed);
            }
            reply(w, option, proto::REP_ERR_SHUTDOWN, b"server shutting down")?;
            w.flush()?;
            continue;
        }

        match option {
            proto::OPT_EXPORT_NAME => {
                let Ok(name) = proto::decode_export_name(&data) else {
                    return Ok(Outcome::Closed);
                };
                let Some(export) = provider.open(&name) else {
                    return Ok(Outcome::Closed);
                };
                let flags = proto::transmission_flags(
                    export.read_only(),
                    provider.flush_covers_all_connections(),
                    export.fast_zero_granule().is_some(),
                );
                w.write_all(&proto::encode_export_name_reply(
                    export.size_bytes(),
                    flags,
                    no_zeroes,
                ))?;
                transmitting.store(true, Ordering::SeqCst);
                w.flush()?;
                return Ok(Outcome::Transmission { export });
            }
            proto::OPT_LIST => {
                if data.is_empty() {
                    for e in provider.list() {
                        reply(
                            w,
                            option,
                            proto::REP_SERVER,
                            &proto::encode_rep_server(&e.name, &e.description),
                        )?;
                    }
                    reply(w, option, proto::REP_ACK, &[])?;
                } else {
                    reply(
                        w,
                        option,
                        proto::REP_ERR_INVALID,
                        b"NBD_OPT_LIST takes no data",
                    )?;
                }
            }
            proto::OPT_INFO | proto::OPT_GO => {
                if let Some(export) = answer_info(w, option, &data, max_payload, provider)? {
                    if option == proto::OPT_GO {
                        transmitting.store(true, Ordering::SeqCst);
                        w.flush()?;
                        return Ok(Outcome::Transmission { export });
                    }
                }
            }
            _ => {
                reply(w, option, proto::REP_ERR_UNSUP, b"option not supported")?;
            }
        }
        w.flush()?;
    }
}

/// Answers `NBD_OPT_INFO` / `NBD_OPT_GO`: the requested information, always
/// `NBD_INFO_EXPORT` and `NBD_INFO_BLOCK_SIZE` (maximum payload
/// `max_payload`), then `NBD_REP_ACK`. Returns the export if the answer
/// was positive.
fn answer_info<W: Write + ?Sized>(
    w: &mut W,
    option: u32,
    data: &[u8],
    max_payload: u32,
    provider: &dyn ExportProvider,
) -> io::Result<Option<Arc<dyn Export>>> {
    let req = match proto::decode_info_request(data) {
        Ok(req) => req,
        Err(e) => {
            reply(w, option, proto::REP_ERR_INVALID, e.to_string().as_bytes())?;
            return Ok(None);
        }
    };
    let Some(export) = provider.open(&req.name) else {
        reply(w, option, proto::REP_ERR_UNKNOWN, b"no such export")?;
        return Ok(None);
    };
    let flags = proto::transmission_flags(
        export.read_only(),
        provider.flush_covers_all_connections(),
        export.fast_zero_granule().is_some(),
    );
    // The name NBD_REP_SERVER would list (the default export's own name
    // when the client asked for "").
    let name = provider.canonical_name(&req.name);
    let mut sent_name = false;
    let mut sent_description = false;
    for t in &req.info_types {
        match *t {
            proto::INFO_NAME if !sent_name => {
                sent_name = true;
                let d = proto::encode_info_string(proto::INFO_NAME, &name);
                reply(w, option, proto::REP_INFO, &d)?;
            }
            proto::INFO_DESCRIPTION if !sent_description => {
                sent_description = true;
                let description = provider
                    .list()
                    .into_iter()
                    .find(|e| e.name == name)
                    .map(|e| e.description)
                    .unwrap_or_default();
                if !description.is_empty() && description.len() <= proto::MAX_STRING_LEN {
                    let d = proto::encode_info_string(proto::INFO_DESCRIPTION, &description);
                    reply(w, option, proto::REP_INFO, &d)?;
                }
            }
            // NBD_INFO_EXPORT and NBD_INFO_BLOCK_SIZE are always sent below;
            // unknown types are ignored, as the spec allows.
            _ => {}
        }
    }
    reply(
        w,
        option,
        proto::REP_INFO,
        &proto::encode_info_export(export.size_bytes(), flags),
    )?;
    reply(
        w,
        option,
        proto::REP_INFO,
        &proto::encode_info_block_size(
            proto::BLOCK_SIZE_MIN,
            proto::BLOCK_SIZE_PREFERRED,
            max_payload,
        ),
    )?;
    reply(w, option, proto::REP_ACK, &[])?;
    Ok(Some(export))
}
