//! HMAC-SHA256 message signatures. Spec: "The Wire Protocol" of the messaging doc: the
//! signature is the hex HMAC of the header, parent header, metadata and content frames, in
//! that order; buffers are not signed. An empty key means messages are not signed.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

type HmacSha256 = Hmac<Sha256>;

/// Why a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("message is unsigned but the kernel uses a key")]
    Unsigned,
    #[error("message signature does not match (wrong key or tampered message)")]
    SignatureMismatch,
}

/// A kernel's signing key, keyed once and cloned per message.
#[derive(Clone)]
pub struct SigningKey {
    mac: Option<HmacSha256>,
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the key.
        f.debug_struct("SigningKey")
            .field("signs", &self.mac.is_some())
            .finish()
    }
}

impl SigningKey {
    /// The key's bytes are used as written in the connection file (the hex string itself,
    /// not its decoded value), as jupyter_client does.
    pub fn new(key: &[u8]) -> Self {
        let mac = (!key.is_empty())
            .then(|| HmacSha256::new_from_slice(key).ok())
            .flatten();
        SigningKey { mac }
    }

    /// No signing and no checking (a connection file with `"key": ""`).
    pub fn unsigned() -> Self {
        SigningKey { mac: None }
    }

    /// A fresh random 256-bit key, as hex, for a new kernel's connection file.
    pub fn generate_hex() -> String {
        use rand::RngCore;
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        hex::encode(bytes)
    }

    pub fn is_signing(&self) -> bool {
        self.mac.is_some()
    }

    /// The hex signature of the four JSON frames (empty when unsigned).
    pub fn sign(&self, parts: [&[u8]; 4]) -> String {
        match &self.mac {
            None => String::new(),
            Some(mac) => hex::encode(Self::digest(mac, parts)),
        }
    }

    /// Checks `signature` (hex, as on the wire) in constant time.
    pub fn verify(&self, signature: &[u8], parts: [&[u8]; 4]) -> Result<(), SignatureError> {
        let Some(mac) = &self.mac else {
            return Ok(());
        };
        if signature.is_empty() {
            return Err(SignatureError::Unsigned);
        }
        // jupyter_client compares hex strings, so `ABCD…` is not the signature `abcd…`;
        // accepting both would give one message two valid signatures.
        if signature.iter().any(u8::is_ascii_uppercase) {
            return Err(SignatureError::SignatureMismatch);
        }
        let expected = hex::decode(signature).map_err(|_| SignatureError::SignatureMismatch)?;
        let mut mac = mac.clone();
        for p in parts {
            mac.update(p);
        }
        mac.verify_slice(&expected)
            .map_err(|_| SignatureError::SignatureMismatch)
    }

    fn digest(mac: &HmacSha256, parts: [&[u8]; 4]) -> [u8; 32] {
        let mut mac = mac.clone();
        for p in parts {
            mac.update(p);
        }
        mac.finalize().into_bytes().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARTS: [&[u8]; 4] = [b"{\"a\":1}", b"{}", b"{}", b"{\"code\":\"1\"}"];

    #[test]
    fn sign_then_verify() {
        let k = SigningKey::new(b"secret");
        let sig = k.sign(PARTS);
        assert_eq!(sig.len(), 64);
        assert_eq!(k.verify(sig.as_bytes(), PARTS), Ok(()));
        assert_eq!(
            SigningKey::new(b"other").verify(sig.as_bytes(), PARTS),
            Err(SignatureError::SignatureMismatch)
        );
        assert_eq!(k.verify(b"", PARTS), Err(SignatureError::Unsigned));
        assert_eq!(
            k.verify(sig.to_uppercase().as_bytes(), PARTS),
            Err(SignatureError::SignatureMismatch)
        );
        assert_eq!(
            k.verify(b"zz", PARTS),
            Err(SignatureError::SignatureMismatch)
        );
    }

    #[test]
    fn empty_key_does_not_sign() {
        let k = SigningKey::new(b"");
        assert!(!k.is_signing());
        assert_eq!(k.sign(PARTS), "");
        assert_eq!(k.verify(b"anything", PARTS), Ok(()));
    }

    #[test]
    fn generated_keys_differ() {
        let a = SigningKey::generate_hex();
        assert_eq!(a.len(), 64);
        assert_ne!(a, SigningKey::generate_hex());
        assert!(!format!("{:?}", SigningKey::new(a.as_bytes())).contains(&a));
    }
}
