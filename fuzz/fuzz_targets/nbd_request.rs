//! Fuzz target: the NBD protocol decoders of `dedupd_nbd::proto`.
//!
//! The input is read twice:
//! 1. every decoder is given the whole input, and each successful decode is
//!    checked against the bytes it came from (fields, lengths, re-encoding
//!    where the crate has an encoder);
//! 2. as a client's byte stream in the order the server reads it: client
//!    flags, option headers each followed by their data (decoded according
//!    to the option), then — after `EXPORT_NAME` or `GO` — request headers,
//!    skipping the payload of each `WRITE`.
#![no_main]

use dedupd_nbd::proto::{self, Command, ProtoError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    each_decoder(data);
    stream(data);
});

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn check_string(bytes: &[u8], r: &Result<String, ProtoError>) {
    match r {
        Ok(s) => {
            assert_eq!(s.as_bytes(), bytes);
            assert!(bytes.len() <= proto::MAX_STRING_LEN);
            assert!(!bytes.contains(&0));
        }
        Err(ProtoError::StringTooLong(n)) => {
            assert_eq!(*n, bytes.len());
            assert!(bytes.len() > proto::MAX_STRING_LEN);
        }
        Err(ProtoError::BadString) => {
            assert!(bytes.contains(&0) || std::str::from_utf8(bytes).is_err());
        }
        Err(e) => panic!("unexpected string error {e:?}"),
    }
}

fn check_request(bytes: &[u8]) -> Option<proto::Request> {
    match proto::decode_request(bytes) {
        Ok(r) => {
            assert!(bytes.len() >= proto::REQUEST_HEADER_LEN);
            assert_eq!(be32(bytes), proto::REQUEST_MAGIC);
            assert_eq!(r.flags, u16::from_be_bytes([bytes[4], bytes[5]]));
            let ty = u16::from_be_bytes([bytes[6], bytes[7]]);
            assert_eq!(r.command, Command::from_wire(ty));
            assert_eq!(r.handle.to_be_bytes(), bytes[8..16]);
            assert_eq!(r.offset.to_be_bytes(), bytes[16..24]);
            assert_eq!(r.length.to_be_bytes(), bytes[24..28]);
            // FUA is allowed on every command
            assert_ne!(r.command.allowed_flags() & proto::CMD_FLAG_FUA, 0);
            // the reply header the server would send for it
            let reply = proto::encode_simple_reply(proto::NBD_EINVAL, r.handle);
            assert_eq!(be32(&reply), proto::SIMPLE_REPLY_MAGIC);
            assert_eq!(be32(&reply[4..]), proto::NBD_EINVAL);
            assert_eq!(reply[8..16], r.handle.to_be_bytes());
            Some(r)
        }
        Err(ProtoError::Short { needed, got }) => {
            assert_eq!(needed, proto::REQUEST_HEADER_LEN);
            assert_eq!(got, bytes.len());
            assert!(got < needed);
            None
        }
        Err(ProtoError::BadMagic { expected, got }) => {
            assert_eq!(expected, u64::from(proto::REQUEST_MAGIC));
            assert_eq!(got, u64::from(be32(bytes)));
            assert_ne!(got, expected);
            None
        }
        Err(e) => panic!("unexpected request error {e:?}"),
    }
}

fn check_option_header(bytes: &[u8]) -> Option<proto::OptionHeader> {
    match proto::decode_option_header(bytes) {
        Ok(h) => {
            assert!(bytes.len() >= proto::OPTION_HEADER_LEN);
            assert_eq!(bytes[0..8], proto::IHAVEOPT.to_be_bytes());
            assert_eq!(h.option, be32(&bytes[8..]));
            assert_eq!(h.length, be32(&bytes[12..]));
            Some(h)
        }
        Err(ProtoError::Short { needed, got }) => {
            assert_eq!((needed, got), (proto::OPTION_HEADER_LEN, bytes.len()));
            None
        }
        Err(ProtoError::BadMagic { expected, got }) => {
            assert_eq!(expected, proto::IHAVEOPT);
            assert_ne!(got, expected);
            None
        }
        Err(e) => panic!("unexpected option header error {e:?}"),
    }
}

fn check_client_flags(bytes: &[u8]) -> Option<u32> {
    match proto::decode_client_flags(bytes) {
        Ok(f) => {
            assert_eq!(f, be32(bytes));
            assert_eq!(f & !proto::KNOWN_CLIENT_FLAGS, 0);
            Some(f)
        }
        Err(ProtoError::Short { .. }) => {
            assert!(bytes.len() < proto::CLIENT_FLAGS_LEN);
            None
        }
        Err(ProtoError::UnknownClientFlags(f)) => {
            assert_eq!(f, be32(bytes));
            assert_ne!(f & !proto::KNOWN_CLIENT_FLAGS, 0);
            None
        }
        Err(e) => panic!("unexpected client flags error {e:?}"),
    }
}

fn check_info_request(bytes: &[u8]) {
    if let Ok(req) = proto::decode_info_request(bytes) {
        // the data must have exactly this layout: encoding it again gives
        // the same bytes
        let mut b = (req.name.len() as u32).to_be_bytes().to_vec();
        b.extend_from_slice(req.name.as_bytes());
        b.extend_from_slice(&(req.info_types.len() as u16).to_be_bytes());
        for t in &req.info_types {
            b.extend_from_slice(&t.to_be_bytes());
        }
        assert_eq!(b, bytes, "INFO/GO data does not re-encode to itself");
        assert!(req.name.len() <= proto::MAX_STRING_LEN);
    }
}

fn each_decoder(data: &[u8]) {
    check_request(data);
    check_option_header(data);
    check_client_flags(data);
    check_string(data, &proto::decode_export_name(data));
    check_string(data, &proto::decode_string(data));
    check_info_request(data);
    // option replies carry arbitrary data with its length
    let reply = proto::encode_option_reply(proto::OPT_GO, proto::REP_ERR_UNSUP, data);
    assert_eq!(reply.len(), proto::OPTION_REPLY_HEADER_LEN + data.len());
    assert_eq!(
        be32(&reply[16..]) as usize,
        data.len().min(u32::MAX as usize)
    );
    // never writes past a short buffer
    let mut short = data.to_vec();
    short.truncate(proto::SIMPLE_REPLY_HEADER_LEN);
    proto::write_simple_reply_header(&mut short, 0, 0);
}

fn stream(data: &[u8]) {
    let Some(_flags) = check_client_flags(data) else {
        return;
    };
    let mut rest = &data[proto::CLIENT_FLAGS_LEN..];
    // option haggling
    loop {
        let Some(h) = check_option_header(rest) else {
            return;
        };
        rest = &rest[proto::OPTION_HEADER_LEN..];
        if h.length > proto::MAX_OPTION_DATA_LEN || h.length as usize > rest.len() {
            return; // the server refuses or waits for more
        }
        let (opt, tail) = rest.split_at(h.length as usize);
        rest = tail;
        match h.option {
            proto::OPT_EXPORT_NAME => {
                check_string(opt, &proto::decode_export_name(opt));
                break;
            }
            proto::OPT_GO => {
                check_info_request(opt);
                if proto::decode_info_request(opt).is_ok() {
                    break;
                }
            }
            proto::OPT_INFO => check_info_request(opt),
            proto::OPT_ABORT => return,
            _ => {}
        }
    }
    // transmission
    while let Some(r) = check_request(rest) {
        rest = &rest[proto::REQUEST_HEADER_LEN..];
        match r.command {
            Command::Write => {
                let n = (r.length as usize).min(rest.len());
                rest = &rest[n..];
            }
            Command::Disc => return,
            _ => {}
        }
    }
}
