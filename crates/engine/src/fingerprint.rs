//! Block fingerprints and the hash algorithms that make them.

use serde::{Deserialize, Serialize};
use sha2::Digest;

/// Size in bytes of a stored fingerprint (the full SHA-256 or BLAKE3 digest).
pub const FINGERPRINT_SIZE: usize = 32;

/// Cryptographic hash of one block's content (32 bytes).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub [u8; FINGERPRINT_SIZE]);

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…")
    }
}

impl Fingerprint {
    /// A fingerprint from a digest of up to 32 bytes (e.g. the 16-byte MD5
    /// digests of block traces), zero-padded on the right; longer digests
    /// are truncated to 32 bytes.
    pub fn from_digest(digest: &[u8]) -> Fingerprint {
        let mut fp = [0u8; FINGERPRINT_SIZE];
        let n = digest.len().min(FINGERPRINT_SIZE);
        fp[..n].copy_from_slice(&digest[..n]);
        Fingerprint(fp)
    }
}

/// Hash algorithm of a store, chosen when the store is created and recorded
/// in its superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum HashAlgorithm {
    /// SHA-256 (FIPS 180-4); the default.
    #[default]
    Sha256,
    /// BLAKE3 (256-bit output); faster where SHA extensions are missing.
    Blake3,
}

impl HashAlgorithm {
    /// Fingerprint of `block` (any length; the engine passes 4 KiB blocks).
    pub fn fingerprint(self, block: &[u8]) -> Fingerprint {
        match self {
            HashAlgorithm::Sha256 => Fingerprint(sha2::Sha256::digest(block).into()),
            HashAlgorithm::Blake3 => Fingerprint(*blake3::hash(block).as_bytes()),
        }
    }

    /// Name as written in the superblock and accepted on the command line.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgorithm::Sha256 => "sha256",
            HashAlgorithm::Blake3 => "blake3",
        }
    }
}

impl std::str::FromStr for HashAlgorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "sha256" | "sha-256" => Ok(HashAlgorithm::Sha256),
            "blake3" => Ok(HashAlgorithm::Blake3),
            other => Err(format!(
                "unknown hash algorithm {other:?} (expected sha256 or blake3)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digests() {
        let fp = HashAlgorithm::Sha256.fingerprint(b"abc");
        assert_eq!(fp.0[..4], [0xba, 0x78, 0x16, 0xbf]);
        let fp = HashAlgorithm::Blake3.fingerprint(b"");
        assert_eq!(fp.0[..4], [0xaf, 0x13, 0x49, 0xb9]);
        assert_ne!(
            HashAlgorithm::Sha256.fingerprint(&[1u8; 4096]),
            HashAlgorithm::Sha256.fingerprint(&[2u8; 4096])
        );
    }
}

/// A [`std::hash::Hasher`] for maps keyed by [`Fingerprint`]: a fingerprint
/// is already the output of a cryptographic hash, so its first 8 bytes
/// (mixed with the slice length the derived `Hash` writes first) serve as
/// the hash, without a SipHash pass over 32 bytes. For short-lived maps of
/// one request; not for maps an adversary can grow without bound.
#[derive(Debug, Default, Clone, Copy)]
pub struct FingerprintHasher(u64);

impl std::hash::Hasher for FingerprintHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut word = [0u8; 8];
        let n = bytes.len().min(8);
        word[..n].copy_from_slice(&bytes[..n]);
        self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(word);
    }
}

/// A hash map keyed by fingerprint with [`FingerprintHasher`].
pub type FingerprintMap<V> =
    std::collections::HashMap<Fingerprint, V, std::hash::BuildHasherDefault<FingerprintHasher>>;
