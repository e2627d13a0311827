//! Byte quantities as users write them: `256Mi`, `1Gi`, `1073741824`, `10G`.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A size in bytes that keeps the text the user wrote, so objects read back
/// the way they were applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantity {
    text: String,
    bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid quantity {text:?}: {why} (write a whole number of bytes with an optional suffix Ki, Mi, Gi, Ti or K, M, G, T; for example 256Mi)"
)]
pub struct QuantityError {
    pub text: String,
    pub why: &'static str,
}

impl Quantity {
    pub fn parse(text: &str) -> Result<Self, QuantityError> {
        let err = |why| QuantityError {
            text: text.to_string(),
            why,
        };
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (digits, suffix) = t.split_at(split);
        if digits.is_empty() {
            return Err(err("it does not start with a number"));
        }
        let number: u64 = digits.parse().map_err(|_| err("the number is too large"))?;
        let multiplier: u64 = match suffix {
            "" => 1,
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            "Ti" => 1 << 40,
            "K" | "k" => 1_000,
            "M" => 1_000_000,
            "G" => 1_000_000_000,
            "T" => 1_000_000_000_000,
            _ => return Err(err("unknown suffix")),
        };
        let bytes = number
            .checked_mul(multiplier)
            .ok_or_else(|| err("the size is too large"))?;
        Ok(Quantity {
            text: t.to_string(),
            bytes,
        })
    }

    pub fn from_bytes(bytes: u64) -> Self {
        let text = if bytes.is_multiple_of(1 << 30) && bytes > 0 {
            format!("{}Gi", bytes >> 30)
        } else if bytes.is_multiple_of(1 << 20) && bytes > 0 {
            format!("{}Mi", bytes >> 20)
        } else {
            bytes.to_string()
        };
        Quantity { text, bytes }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn mebibytes(&self) -> u64 {
        self.bytes >> 20
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(Quantity {
                text: n.to_string(),
                bytes: n,
            }),
            Raw::Text(t) => Quantity::parse(&t).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_and_decimal_suffixes() {
        assert_eq!(Quantity::parse("256Mi").unwrap().bytes(), 256 << 20);
        assert_eq!(Quantity::parse("1Gi").unwrap().bytes(), 1 << 30);
        assert_eq!(Quantity::parse("10G").unwrap().bytes(), 10_000_000_000);
        assert_eq!(Quantity::parse("4096").unwrap().bytes(), 4096);
    }

    #[test]
    fn garbage_is_refused_with_the_text() {
        let e = Quantity::parse("12XB").unwrap_err();
        assert!(e.to_string().contains("\"12XB\""), "{e}");
        assert!(Quantity::parse("Mi").is_err());
        assert!(Quantity::parse("").is_err());
        assert!(Quantity::parse("-1Gi").is_err());
        assert!(Quantity::parse("99999999999999Ti").is_err());
    }

    #[test]
    fn from_bytes_round_trips() {
        for b in [1u64, 4096, 1 << 20, 3 << 30, 12345] {
            let q = Quantity::from_bytes(b);
            assert_eq!(Quantity::parse(&q.to_string()).unwrap().bytes(), b);
        }
    }
}
