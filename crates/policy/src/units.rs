//! Human-friendly sizes ("256MiB") and durations ("30s", "5m") used in `limits`.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// A byte count written like `512MiB`, `1GiB` or `4096`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses the YAML form; the error names the accepted spellings.
    pub fn parse(text: &str) -> Result<Self, String> {
        text.trim()
            .parse::<bytesize::ByteSize>()
            .map(|size| Self(size.as_u64()))
            .map_err(|_| format!("`{text}` is not a size; write it like 512MiB, 2GiB or 1048576"))
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
        let raw = SizeOrNumber::deserialize(deserializer)?;
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
    }

    #[test]
    fn durations_parse_human_forms() {
        assert_eq!(Duration::parse("30s").map(|d| d.0.as_secs()), Ok(30));
        assert_eq!(Duration::parse("5m").map(|d| d.0.as_secs()), Ok(300));
        assert!(Duration::parse("soon").is_err());
    }
}
