//! NBD wire format: constants and pure decode/encode functions.
//!
//! Everything here works on byte slices and owned byte vectors; nothing does
//! I/O. All integers on the wire are big-endian (network byte order).
//! Section names in the docs refer to `doc/proto.md` of NetworkBlockDevice/nbd.

use crate::export::ExportError;

// ---------------------------------------------------------------------------
// Magic numbers ("Handshake" and "Transmission" sections)
// ---------------------------------------------------------------------------

/// `NBDMAGIC` (`INIT_PASSWD`): first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: second 8 bytes of the greeting, and the magic of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every fixed-newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// `NBD_REQUEST_MAGIC`: first 4 bytes of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// `NBD_SIMPLE_REPLY_MAGIC`: first 4 bytes of every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

// ---------------------------------------------------------------------------
// Handshake flags ("Handshake flags", "Client flags")
// ---------------------------------------------------------------------------

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server may omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client does not want the 124 zero bytes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;
/// Every client flag this server understands; any other bit closes the connection.
pub const KNOWN_CLIENT_FLAGS: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;

// ---------------------------------------------------------------------------
// Options ("Option types")
// ---------------------------------------------------------------------------

/// `NBD_OPT_EXPORT_NAME`: choose an export and enter transmission (no reply on error).
pub const OPT_EXPORT_NAME: u32 = 1;
/// `NBD_OPT_ABORT`: end the negotiation (soft disconnect).
pub const OPT_ABORT: u32 = 2;
/// `NBD_OPT_LIST`: list exports.
pub const OPT_LIST: u32 = 3;
/// `NBD_OPT_STARTTLS`: not supported here.
pub const OPT_STARTTLS: u32 = 5;
/// `NBD_OPT_INFO`: describe an export, stay in negotiation.
pub const OPT_INFO: u32 = 6;
/// `NBD_OPT_GO`: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// `NBD_OPT_STRUCTURED_REPLY`: not supported here (answered `NBD_REP_ERR_UNSUP`).
pub const OPT_STRUCTURED_REPLY: u32 = 8;

// ---------------------------------------------------------------------------
// Option replies ("Option reply types")
// ---------------------------------------------------------------------------

/// `NBD_REP_ACK`: option accepted / final reply of a list.
pub const REP_ACK: u32 = 1;
/// `NBD_REP_SERVER`: one export of an `NBD_OPT_LIST`.
pub const REP_SERVER: u32 = 2;
/// `NBD_REP_INFO`: one information item of `NBD_OPT_INFO` / `NBD_OPT_GO`.
pub const REP_INFO: u32 = 3;
/// `NBD_REP_ERR_UNSUP`: option unknown to this server.
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
/// `NBD_REP_ERR_POLICY`: option refused by policy.
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
/// `NBD_REP_ERR_INVALID`: option syntactically invalid.
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
/// `NBD_REP_ERR_UNKNOWN`: the requested export does not exist.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
/// `NBD_REP_ERR_SHUTDOWN`: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
/// `NBD_REP_ERR_TOO_BIG`: the option data is too large to process.
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

// ---------------------------------------------------------------------------
// Info types (`NBD_REP_INFO` payloads)
// ---------------------------------------------------------------------------

/// `NBD_INFO_EXPORT`: size (u64) and transmission flags (u16).
pub const INFO_EXPORT: u16 = 0;
/// `NBD_INFO_NAME`: the export's name.
pub const INFO_NAME: u16 = 1;
/// `NBD_INFO_DESCRIPTION`: human-readable description.
pub const INFO_DESCRIPTION: u16 = 2;
/// `NBD_INFO_BLOCK_SIZE`: minimum, preferred and maximum block sizes (u32 each).
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------
// Transmission flags ("Transmission flags")
// ---------------------------------------------------------------------------

/// `NBD_FLAG_HAS_FLAGS`: always set.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// `NBD_FLAG_READ_ONLY`: writes are refused.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_FLAG_SEND_FLUSH`: `NBD_CMD_FLUSH` supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_FLAG_SEND_FUA`: `NBD_CMD_FLAG_FUA` supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// `NBD_FLAG_SEND_TRIM`: `NBD_CMD_TRIM` supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_FLAG_SEND_WRITE_ZEROES`: `NBD_CMD_WRITE_ZEROES` supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// `NBD_FLAG_CAN_MULTI_CONN`: a flush on one connection covers all of them.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// `NBD_FLAG_SEND_FAST_ZERO`: `NBD_CMD_FLAG_FAST_ZERO` supported on
/// WRITE_ZEROES.
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---------------------------------------------------------------------------
// Commands and command flags ("Request types", "Command flags")
// ---------------------------------------------------------------------------

/// `NBD_CMD_READ`.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE` (followed by `length` payload bytes).
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`: soft disconnect, no reply.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`.
pub const CMD_TRIM: u16 = 4;
/// `NBD_CMD_WRITE_ZEROES`.
pub const CMD_WRITE_ZEROES: u16 = 6;

/// `NBD_CMD_FLAG_FUA`: the reply waits until the data is durable.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// `NBD_CMD_FLAG_NO_HOLE`: (WRITE_ZEROES) do not punch a hole. Accepted,
/// but a deduplicating store never stores zero blocks and cannot reserve
/// space for later writes: the range is unmapped as without it (README,
/// "NBD").
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// `NBD_CMD_FLAG_FAST_ZERO`: (WRITE_ZEROES) fail with `NBD_ENOTSUP` at once
/// unless the zeroing is faster than a write (see
/// [`crate::Export::fast_zero_granule`]).
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// ---------------------------------------------------------------------------
// Error values ("Error values")
// ---------------------------------------------------------------------------

/// `NBD_EPERM`: operation not permitted (e.g. write to a read-only export).
pub const NBD_EPERM: u32 = 1;
/// `NBD_EIO`: input/output error.
pub const NBD_EIO: u32 = 5;
/// `NBD_ENOMEM`: out of memory.
pub const NBD_ENOMEM: u32 = 12;
/// `NBD_EINVAL`: invalid argument (bad range, flags, length or command).
pub const NBD_EINVAL: u32 = 22;
/// `NBD_ENOSPC`: no space left.
pub const NBD_ENOSPC: u32 = 28;
/// `NBD_ENOTSUP`: operation not supported (a FAST_ZERO that would not be
/// fast).
pub const NBD_ENOTSUP: u32 = 95;
/// `NBD_ESHUTDOWN`: server shutting down.
pub const NBD_ESHUTDOWN: u32 = 108;

// ---------------------------------------------------------------------------
// Sizes and limits
// ---------------------------------------------------------------------------

/// Bytes of the server greeting (NBDMAGIC, IHAVEOPT, handshake flags).
pub const GREETING_LEN: usize = 18;
/// Bytes of the client flags field.
pub const CLIENT_FLAGS_LEN: usize = 4;
/// Bytes of an option header (IHAVEOPT, option, length).
pub const OPTION_HEADER_LEN: usize = 16;
/// Bytes of an option reply header (magic, option, reply type, length).
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
/// Bytes of a request header (magic, flags, type, handle, offset, length).
pub const REQUEST_HEADER_LEN: usize = 28;
/// Bytes of a simple reply header (magic, error, handle).
pub const SIMPLE_REPLY_HEADER_LEN: usize = 16;
/// Longest string (export name, description) the spec allows, in bytes.
pub const MAX_STRING_LEN: usize = 4096;
/// Largest option data this server reads into memory, in bytes (8 KiB:
/// room for the longest export name the spec allows, 4096 bytes, and
/// a thousand information requests); longer option data is discarded
/// unread and answered `NBD_REP_ERR_TOO_BIG`.
pub const MAX_OPTION_DATA_LEN: u32 = 8 * 1024;
/// Advertised minimum block size, in bytes.
pub const BLOCK_SIZE_MIN: u32 = 1;
/// Advertised preferred block size, in bytes.
pub const BLOCK_SIZE_PREFERRED: u32 = 4096;
/// The protocol's default maximum payload, in bytes (32 MiB): the longest
/// READ or WRITE this server accepts from any client, and the largest
/// maximum payload it advertises (TRIM and WRITE_ZEROES carry no payload
/// and may be longer).
pub const BLOCK_SIZE_MAX: u32 = 32 * 1024 * 1024;

/// Why some bytes are not a valid protocol message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The buffer is shorter than the message.
    #[error("message too short: need {needed} bytes, have {got}")]
    Short {
        /// Bytes the message needs.
        needed: usize,
        /// Bytes that were available.
        got: usize,
    },
    /// A magic number did not match.
    #[error("bad magic: expected {expected:#x}, got {got:#x}")]
    BadMagic {
        /// The magic the protocol requires.
        expected: u64,
        /// The magic received.
        got: u64,
    },
    /// The client set client flags this server does not know.
    #[error("unknown client flags {0:#x}")]
    UnknownClientFlags(u32),
    /// A length field disagrees with the length of the surrounding data.
    #[error("inconsistent length field: {0}")]
    BadLength(&'static str),
    /// A string is longer than the 4096 bytes the spec allows.
    #[error("string of {0} bytes is longer than 4096")]
    StringTooLong(usize),
    /// A string is not UTF-8 or contains NUL.
    #[error("string is not valid UTF-8 without NUL")]
    BadString,
}

fn need(buf: &[u8], n: usize) -> Result<(), ProtoError> {
    if buf.len() < n {
        Err(ProtoError::Short {
            needed: n,
            got: buf.len(),
        })
    } else {
        Ok(())
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Decodes a protocol string (export name, ...): UTF-8, no NUL, at most
/// [`MAX_STRING_LEN`] bytes.
///
/// Errors: [`ProtoError::StringTooLong`], [`ProtoError::BadString`].
pub fn decode_string(bytes: &[u8]) -> Result<String, ProtoError> {
    if bytes.len() > MAX_STRING_LEN {
        return Err(ProtoError::StringTooLong(bytes.len()));
    }
    if bytes.contains(&0) {
        return Err(ProtoError::BadString);
    }
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .map_err(|_| ProtoError::BadString)
}

/// Encodes the server greeting of fixed newstyle negotiation ("Newstyle
/// negotiation"): `NBDMAGIC`, `IHAVEOPT`, handshake flags
/// `FIXED_NEWSTYLE | NO_ZEROES`. Always [`GREETING_LEN`] bytes.
pub fn encode_greeting() -> [u8; GREETING_LEN] {
    let mut b = [0u8; GREETING_LEN];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    b
}

/// Decodes the 32-bit client flags ("Client flags").
///
/// Errors: [`ProtoError::Short`] under 4 bytes;
/// [`ProtoError::UnknownClientFlags`] if a bit outside
/// [`KNOWN_CLIENT_FLAGS`] is set (the server must then close).
pub fn decode_client_flags(buf: &[u8]) -> Result<u32, ProtoError> {
    need(buf, CLIENT_FLAGS_LEN)?;
    let flags = be32(buf, 0);
    if flags & !KNOWN_CLIENT_FLAGS != 0 {
        return Err(ProtoError::UnknownClientFlags(flags));
    }
    Ok(flags)
}

/// Header of one option sent during option haggling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option code (`NBD_OPT_*`).
    pub option: u32,
    /// Length in bytes of the option data that follows.
    pub length: u32,
}

/// Decodes a 16-byte option header (`IHAVEOPT`, option, length).
///
/// Errors: [`ProtoError::Short`], [`ProtoError::BadMagic`].
pub fn decode_option_header(buf: &[u8]) -> Result<OptionHeader, ProtoError> {
    need(buf, OPTION_HEADER_LEN)?;
    let magic = be64(buf, 0);
    if magic != IHAVEOPT {
        return Err(ProtoError::BadMagic {
            expected: IHAVEOPT,
            got: magic,
        });
    }
    Ok(OptionHeader {
        option: be32(buf, 8),
        length: be32(buf, 12),
    })
}

/// Decodes the data of `NBD_OPT_EXPORT_NAME`: the whole data is the name.
///
/// Errors: as [`decode_string`].
pub fn decode_export_name(data: &[u8]) -> Result<String, ProtoError> {
    decode_string(data)
}

/// The data of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// Export name (empty: the default export).
    pub name: String,
    /// Information types (`NBD_INFO_*`) the client asked for, in order.
    pub info_types: Vec<u16>,
}

/// Decodes the data of `NBD_OPT_INFO` / `NBD_OPT_GO`: u32 name length,
/// name, u16 count, `count` u16 information types. The data must have
/// exactly this length.
///
/// Errors: [`ProtoError::Short`], [`ProtoError::BadLength`] if the length
/// fields disagree with the data, and the errors of [`decode_string`].
pub fn decode_info_request(data: &[u8]) -> Result<InfoRequest, ProtoError> {
    need(data, 6)?;
    let name_len = be32(data, 0) as usize;
    if name_len > data.len() - 6 {
        return Err(ProtoError::BadLength("export name longer than option data"));
    }
    let name = decode_string(&data[4..4 + name_len])?;
    let rest = &data[4 + name_len..];
    let count = be16(rest, 0) as usize;
    let list = &rest[2..];
    if list.len() != count * 2 {
        return Err(ProtoError::BadLength(
            "information request count disagrees with option length",
        ));
    }
    let info_types = list
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Ok(InfoRequest { name, info_types })
}

/// Encodes one fixed-newstyle option reply: magic, option, reply type,
/// u32 length, data.
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(OPTION_REPLY_HEADER_LEN + data.len());
    b.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&reply_type.to_be_bytes());
    // Callers never pass more than a few KiB; saturate rather than wrap.
    b.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// Encodes the data of an `NBD_REP_SERVER` reply: u32 name length, name,
/// description (free text filling the rest).
pub fn encode_rep_server(name: &str, description: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + name.len() + description.len());
    b.extend_from_slice(&u32::try_from(name.len()).unwrap_or(u32::MAX).to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(description.as_bytes());
    b
}

/// Encodes the data of an `NBD_REP_INFO` reply of type `NBD_INFO_EXPORT`:
/// u16 type, u64 size in bytes, u16 transmission flags (12 bytes).
pub fn encode_info_export(size: u64, transmission_flags: u16) -> Vec<u8> {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&transmission_flags.to_be_bytes());
    b
}

/// Encodes the data of an `NBD_REP_INFO` reply of type `NBD_INFO_BLOCK_SIZE`:
/// u16 type, u32 minimum, u32 preferred, u32 maximum (14 bytes).
pub fn encode_info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(14);
    b.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b.extend_from_slice(&min.to_be_bytes());
    b.extend_from_slice(&preferred.to_be_bytes());
    b.extend_from_slice(&max.to_be_bytes());
    b
}

/// Encodes the data of an `NBD_REP_INFO` reply carrying a string
/// (`NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION`): u16 type, string.
pub fn encode_info_string(info_type: u16, text: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(2 + text.len());
    b.extend_from_slice(&info_type.to_be_bytes());
    b.extend_from_slice(text.as_bytes());
    b
}

/// Encodes the server's answer to `NBD_OPT_EXPORT_NAME`: u64 size in bytes,
/// u16 transmission flags, then 124 zero bytes unless `no_zeroes`.
pub fn encode_export_name_reply(size: u64, transmission_flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut b = Vec::with_capacity(10 + 124);
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&transmission_flags.to_be_bytes());
    if !no_zeroes {
        b.extend_from_slice(&[0u8; 124]);
    }
    b
}

/// Transmission flags for an export ("Transmission flags"): always
/// `HAS_FLAGS | SEND_FLUSH`, plus `CAN_MULTI_CONN` when asked for. A
/// writable export also gets `SEND_FUA | SEND_TRIM | SEND_WRITE_ZEROES`
/// and `SEND_FAST_ZERO` when asked for; a read-only one gets `READ_ONLY`
/// instead and none of the write features (each would only ever be
/// answered `NBD_EPERM`).
pub fn transmission_flags(read_only: bool, multi_conn: bool, fast_zero: bool) -> u16 {
    let mut f = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH;
    if read_only {
        f |= TFLAG_READ_ONLY;
    } else {
        f |= TFLAG_SEND_FUA | TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES;
        if fast_zero {
            f |= TFLAG_SEND_FAST_ZERO;
        }
    }
    if multi_conn {
        f |= TFLAG_CAN_MULTI_CONN;
    }
    f
}

/// A transmission-phase command type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `NBD_CMD_READ`.
    Read,
    /// `NBD_CMD_WRITE`.
    Write,
    /// `NBD_CMD_DISC`.
    Disc,
    /// `NBD_CMD_FLUSH`.
    Flush,
    /// `NBD_CMD_TRIM`.
    Trim,
    /// `NBD_CMD_WRITE_ZEROES`.
    WriteZeroes,
    /// Any other type; answered `NBD_EINVAL`, assumed to carry no payload.
    Unknown(u16),
}

impl Command {
    /// Maps a wire command type to a [`Command`].
    pub fn from_wire(t: u16) -> Command {
        match t {
            CMD_READ => Command::Read,
            CMD_WRITE => Command::Write,
            CMD_DISC => Command::Disc,
            CMD_FLUSH => Command::Flush,
            CMD_TRIM => Command::Trim,
            CMD_WRITE_ZEROES => Command::WriteZeroes,
            other => Command::Unknown(other),
        }
    }

    /// Command flags valid for this command: `FUA` on every command (the
    /// spec requires accepting it everywhere once `SEND_FUA` is
    /// advertised), plus `NO_HOLE` and `FAST_ZERO` on WRITE_ZEROES.
    pub fn allowed_flags(self) -> u16 {
        match self {
            Command::WriteZeroes => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            _ => CMD_FLAG_FUA,
        }
    }
}

/// A decoded request header ("Request message").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`NBD_CMD_FLAG_*`).
    pub flags: u16,
    /// Command type.
    pub command: Command,
    /// Opaque handle, echoed in the reply.
    pub handle: u64,
    /// Offset in bytes.
    pub offset: u64,
    /// Length in bytes (of the payload too, for WRITE).
    pub length: u32,
}

/// Encodes a 28-byte request header (a client's side: test clients and
/// fuzzers build requests with it): `flags` (`NBD_CMD_FLAG_*`), command
/// type `cmd` (`NBD_CMD_*`), `handle`, `offset` and `length` in bytes.
pub fn encode_request(
    flags: u16,
    cmd: u16,
    handle: u64,
    offset: u64,
    length: u32,
) -> [u8; REQUEST_HEADER_LEN] {
    let mut b = [0u8; REQUEST_HEADER_LEN];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&cmd.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..24].copy_from_slice(&offset.to_be_bytes());
    b[24..28].copy_from_slice(&length.to_be_bytes());
    b
}

/// Decodes a 28-byte request header.
///
/// Errors: [`ProtoError::Short`], [`ProtoError::BadMagic`] (the server then
/// closes the connection: the stream cannot be resynchronised).
pub fn decode_request(buf: &[u8]) -> Result<Request, ProtoError> {
    need(buf, REQUEST_HEADER_LEN)?;
    let magic = be32(buf, 0);
    if magic != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic {
            expected: u64::from(REQUEST_MAGIC),
            got: u64::from(magic),
        });
    }
    Ok(Request {
        flags: be16(buf, 4),
        command: Command::from_wire(be16(buf, 6)),
        handle: be64(buf, 8),
        offset: be64(buf, 16),
        length: be32(buf, 24),
    })
}

/// Writes a simple reply header (magic, error, handle) into the first 16
/// bytes of `out`. Does nothing if `out` is shorter than 16 bytes.
pub fn write_simple_reply_header(out: &mut [u8], error: u32, handle: u64) {
    if out.len() < SIMPLE_REPLY_HEADER_LEN {
        return;
    }
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&handle.to_be_bytes());
}

/// Encodes a simple reply header without payload ("Simple reply message").
pub fn encode_simple_reply(error: u32, handle: u64) -> [u8; SIMPLE_REPLY_HEADER_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_HEADER_LEN];
    write_simple_reply_header(&mut b, error, handle);
    b
}

/// Maps an [`ExportError`] to the NBD error value sent to the client:
/// `Io` → `NBD_EIO`, `NoSpace` → `NBD_ENOSPC`, `Invalid` → `NBD_EINVAL`,
/// `ReadOnly` → `NBD_EPERM`.
pub fn error_code(e: &ExportError) -> u32 {
    match e {
        ExportError::Io(_) => NBD_EIO,
        ExportError::NoSpace => NBD_ENOSPC,
        ExportError::Invalid(_) => NBD_EINVAL,
        ExportError::ReadOnly => NBD_EPERM,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn option_bytes(option: u32, data: &[u8]) -> Vec<u8> {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        b
    }

    fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
        let mut b = (name.len() as u32).to_be_bytes().to_vec();
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            b.extend_from_slice(&i.to_be_bytes());
        }
        b
    }

    #[test]
    fn greeting_layout() {
        let g = encode_greeting();
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..18], &[0, 3]);
    }

    #[test]
    fn client_flags() {
        assert_eq!(decode_client_flags(&[0, 0, 0, 3]), Ok(3));
        assert_eq!(decode_client_flags(&[0, 0, 0, 0]), Ok(0));
        assert_eq!(
            decode_client_flags(&[0, 0, 0, 4]),
            Err(ProtoError::UnknownClientFlags(4))
        );
        assert!(matches!(
            decode_client_flags(&[0, 0]),
            Err(ProtoError::Short { needed: 4, got: 2 })
        ));
    }

    #[test]
    fn option_header() {
        let b = option_bytes(OPT_GO, b"abc");
        assert_eq!(
            decode_option_header(&b),
            Ok(OptionHeader {
                option: OPT_GO,
                length: 3
            })
        );
        let mut bad = b.clone();
        bad[0] = b'X';
        assert!(matches!(
            decode_option_header(&bad),
            Err(ProtoError::BadMagic { .. })
        ));
        assert!(matches!(
            decode_option_header(&b[..10]),
            Err(ProtoError::Short { .. })
        ));
    }

    #[test]
    fn info_request() {
        let d = info_data("disk", &[INFO_BLOCK_SIZE, INFO_NAME]);
        assert_eq!(
            decode_info_request(&d),
            Ok(InfoRequest {
                name: "disk".into(),
                info_types: vec![INFO_BLOCK_SIZE, INFO_NAME]
            })
        );
        assert_eq!(
            decode_info_request(&info_data("", &[])),
            Ok(InfoRequest {
                name: String::new(),
                info_types: vec![]
            })
        );
        // Name length beyond the data.
        let mut d = info_data("disk", &[]);
        d[3] = 200;
        assert!(matches!(
            decode_info_request(&d),
            Err(ProtoError::BadLength(_))
        ));
        // Count disagrees with data.
        let mut d = info_data("disk", &[1]);
        d.push(0);
        assert!(matches!(
            decode_info_request(&d),
            Err(ProtoError::BadLength(_))
        ));
        let mut d = info_data("disk", &[1, 2]);
        d.pop();
        assert!(decode_info_request(&d).is_err());
        assert!(matches!(
            decode_info_request(&[0, 0, 0]),
            Err(ProtoError::Short { .. })
        ));
        // Bad UTF-8 and NUL.
        assert_eq!(
            decode_info_request(&info_data("a\0b", &[])),
            Err(ProtoError::BadString)
        );
        let mut d = info_data("ab", &[]);
        d[4] = 0xff;
        assert_eq!(decode_info_request(&d), Err(ProtoError::BadString));
    }

    #[test]
    fn strings() {
        assert_eq!(decode_export_name(b"x"), Ok("x".to_string()));
        assert_eq!(decode_export_name(b""), Ok(String::new()));
        assert_eq!(
            decode_export_name(&[b'a'; 4097]),
            Err(ProtoError::StringTooLong(4097))
        );
        assert!(decode_export_name(&[b'a'; 4096]).is_ok());
    }

    #[test]
    fn request() {
        let mut b = encode_request(CMD_FLAG_FUA, CMD_WRITE, 0x1122_3344_5566_7788, 4096, 512);
        assert_eq!(b[..4], REQUEST_MAGIC.to_be_bytes());
        assert_eq!(
            decode_request(&b),
            Ok(Request {
                flags: CMD_FLAG_FUA,
                command: Command::Write,
                handle: 0x1122_3344_5566_7788,
                offset: 4096,
                length: 512
            })
        );
        b[7] = 99;
        assert_eq!(
            decode_request(&b).map(|r| r.command),
            Ok(Command::Unknown(99))
        );
        b[0] = 0;
        assert!(matches!(
            decode_request(&b),
            Err(ProtoError::BadMagic { .. })
        ));
        assert!(matches!(
            decode_request(&b[..27]),
            Err(ProtoError::Short { .. })
        ));
    }

    #[test]
    fn encoders() {
        let r = encode_option_reply(OPT_LIST, REP_ACK, &[]);
        assert_eq!(r.len(), 20);
        assert_eq!(&r[0..8], &OPTION_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&r[8..12], &OPT_LIST.to_be_bytes());
        assert_eq!(&r[12..16], &REP_ACK.to_be_bytes());
        assert_eq!(&r[16..20], &[0, 0, 0, 0]);

        assert_eq!(
            encode_rep_server("ab", "d"),
            vec![0, 0, 0, 2, b'a', b'b', b'd']
        );
        let e = encode_info_export(0x100, 0x1234);
        assert_eq!(e, vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0x12, 0x34]);
        let bs = encode_info_block_size(1, 4096, BLOCK_SIZE_MAX);
        assert_eq!(bs.len(), 14);
        assert_eq!(&bs[0..2], &[0, 3]);
        assert_eq!(&bs[10..14], &(32u32 << 20).to_be_bytes());
        assert_eq!(encode_export_name_reply(1, 1, true).len(), 10);
        assert_eq!(encode_export_name_reply(1, 1, false).len(), 134);
        let s = encode_simple_reply(NBD_EINVAL, 7);
        assert_eq!(&s[0..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&s[4..8], &22u32.to_be_bytes());
        assert_eq!(&s[8..16], &7u64.to_be_bytes());
    }

    #[test]
    fn flags_and_errors() {
        assert_eq!(transmission_flags(false, false, false), 0b0110_1101);
        // read-only: READ_ONLY, FLUSH, MULTI_CONN, no FUA/TRIM/ZEROES
        assert_eq!(transmission_flags(true, true, false), 0b1_0000_0111);
        assert_eq!(transmission_flags(true, false, true), 0b0000_0111);
        assert_eq!(transmission_flags(false, false, true), 0b1000_0110_1101);
        assert_eq!(error_code(&ExportError::Io("x".into())), NBD_EIO);
        assert_eq!(error_code(&ExportError::NoSpace), NBD_ENOSPC);
        assert_eq!(error_code(&ExportError::Invalid("x".into())), NBD_EINVAL);
        assert_eq!(error_code(&ExportError::ReadOnly), NBD_EPERM);
    }
}
