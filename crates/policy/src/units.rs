//! Human-friendly sizes ("256MiB") and durations ("30s", "5m") used in `limits`.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// A byte count written like `512MiB`, `1GiB` or `4096`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses the YAML form; the error names the accepted spellings.
    pub fn parse(text: &str) -> Result<Self, String> {
        let trimmed = text.trim();
        let size = trimmed
            .parse::<bytesize::ByteSize>()
            .map(|size| size.as_u64())
            .map_err(|_| {
                format!("`{text}` is not a size; write it like 512MiB, 2GiB or 1048576")
            })?;
        // The parser saturates: a size past 16 EiB would read as the largest there is, which
        // is no limit at all.
        if size == u64::MAX && past_u64(trimmed) {
            return Err(format!(
                "`{text}` is larger than any size there is (16 EiB); write the limit meant, like 512MiB or 2GiB"
            ));
        }
        Ok(Self(size))
    }
}

/// Whether the size `text` spells (a number and a unit) is past what a `u64` holds.
fn past_u64(text: &str) -> bool {
    let digits = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let factor = match unit.trim() {
        "" => 1,
        unit => format!("1{unit}")
            .parse::<bytesize::ByteSize>()
            .map_or(1, |s| s.as_u64()),
    };
    match number.parse::<u128>() {
        // Whole numbers exactly (a float rounds `u64::MAX` up to 2^64).
        Ok(n) => n
            .checked_mul(u128::from(factor))
            .is_none_or(|n| n > u128::from(u64::MAX)),
        Err(_) => {
            number.parse::<f64>().unwrap_or(0.0) * factor as f64 >= 18_446_744_073_709_551_616.0
        }
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [
            ("TiB", 1 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        for (unit, scale) in UNITS {
            if self.0 >= scale && self.0.is_multiple_of(scale) {
                return write!(f, "{} {unit}", self.0 / scale);
            }
        }
        write!(f, "{} bytes", self.0)
    }
}

/// Written back as the shortest exact form: `2GiB`, `512MiB`, or a number of bytes.
impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        const UNITS: [(&str, u64); 4] = [
            ("TiB", 1 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        for (unit, scale) in UNITS {
            if self.0 >= scale && self.0.is_multiple_of(scale) {
                return serializer.serialize_str(&format!("{}{unit}", self.0 / scale));
            }
        }
        serializer.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // What is neither a whole number of bytes nor text (a negative or fractional number,
        // one too large for 64 bits, a list) gets the same advice as text that is not a size,
        // not the name of the type it did not match.
        let raw = SizeOrNumber::deserialize(deserializer).map_err(|_| {
            de::Error::custom(
                "not a size: write a whole number of bytes (1048576) or a size like 512MiB or 2GiB",
            )
        })?;
        match raw {
            SizeOrNumber::Number(n) => Ok(Self(n)),
            SizeOrNumber::Text(text) => Self::parse(&text).map_err(de::Error::custom),
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeOrNumber {
    Number(u64),
    Text(String),
}

/// A wall-clock duration written like `30s`, `5m` or `1h 30m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Duration(pub std::time::Duration);

impl Duration {
    /// Parses the YAML form; the error names the accepted spellings.
    pub fn parse(text: &str) -> Result<Self, String> {
        humantime::parse_duration(text.trim())
            .map(Self)
            .map_err(|_| format!("`{text}` is not a duration; write it like 30s, 5m or 1h30m"))
    }
}

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl Serialize for Duration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string().replace(' ', ""))
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_binary_units() {
        assert_eq!(ByteSize::parse("256MiB"), Ok(ByteSize(256 << 20)));
        assert_eq!(ByteSize::parse("1 GiB"), Ok(ByteSize(1 << 30)));
        assert!(ByteSize::parse("lots").is_err());
        assert_eq!(ByteSize(256 << 20).to_string(), "256 MiB");
        assert_eq!(ByteSize::parse("16383PiB"), Ok(ByteSize(16383 << 50)));
        assert_eq!(
            ByteSize::parse("18446744073709551615"),
            Ok(ByteSize(u64::MAX))
        );
        assert_eq!(
            ByteSize::parse("18446744073709551615 B"),
            Ok(ByteSize(u64::MAX))
        );
    }

    /// A size past what a `u64` holds is refused, not read as the largest (no limit).
    #[test]
    fn sizes_too_large_to_hold_are_refused() {
        for text in [
            "99999999999999TiB",
            "16EiB",
            "17179869184GiB",
            "20000000000000000000 B",
        ] {
            let err = ByteSize::parse(text).unwrap_err();
            assert!(err.contains("larger than any size"), "{text}: {err}");
        }
    }

    #[test]
    fn durations_parse_human_forms() {
        assert_eq!(Duration::parse("30s").map(|d| d.0.as_secs()), Ok(30));
        assert_eq!(Duration::parse("5m").map(|d| d.0.as_secs()), Ok(300));
        assert!(Duration::parse("soon").is_err());
    }
}
