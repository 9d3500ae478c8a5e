//! Human-readable units used by the configuration file: durations ("10ms",
//! "1m30s") and byte sizes ("100MiB" or a plain integer of bytes).
//!
//! Both types parse strictly: a value that is not exactly understood is an
//! error rather than a guess, because a silently misread interval or limit is
//! far harder to debug than a refused start.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why a duration does not parse: a lowercase reason without the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("empty duration; write e.g. \"10ms\" or \"1s\"")]
    Empty,
    #[error("invalid duration {text:?}: expected a number at position {position}; write e.g. \"10ms\" or \"1s\"")]
    NoNumber { text: String, position: usize },
    #[error("invalid duration {text:?}: number too large")]
    NumberTooLarge { text: String },
    #[error("invalid duration {text:?}: missing unit (ns, us, ms, s, m, h)")]
    MissingUnit { text: String },
    #[error("invalid duration {text:?}: unknown unit {unit:?} (ns, us, ms, s, m, h)")]
    UnknownUnit { text: String, unit: String },
    #[error("invalid duration {text:?}: too large")]
    TooLarge { text: String },
}

/// Why a byte size does not parse: a lowercase reason without the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("invalid size {text:?}: expected a number, e.g. \"100MiB\"")]
    NoNumber { text: String },
    #[error("invalid size {text:?}: number too large")]
    NumberTooLarge { text: String },
    #[error(
        "invalid size {text:?}: unknown unit {unit:?} (B, KiB, MiB, GiB, TiB; KB, MB, GB, TB are the same powers of 1024)"
    )]
    UnknownUnit { text: String, unit: String },
    #[error("invalid size {text:?}: too large")]
    TooLarge { text: String },
}

/// A duration written as a string of one or more `<integer><unit>` segments,
/// e.g. `"500us"`, `"10ms"`, `"1s"`, `"1m"`, `"1h30m"`.
///
/// Units: `ns`, `us` (or `µs`), `ms`, `s`, `m`, `h`. Bare numbers, signs,
/// fractions and unknown units are rejected so "10" never means "10 what?".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConfigDuration(pub Duration);

impl ConfigDuration {
    /// Builds a duration from microseconds.
    pub const fn from_micros(us: u64) -> Self {
        Self(Duration::from_micros(us))
    }

    /// Builds a duration from milliseconds (used for defaults).
    pub const fn from_millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    /// Builds a duration from whole seconds (used for defaults).
    pub const fn from_secs(s: u64) -> Self {
        Self(Duration::from_secs(s))
    }

    /// The wrapped [`Duration`].
    pub const fn get(self) -> Duration {
        self.0
    }

    /// Parses the string form; the error is a lowercase reason without the key.
    pub fn parse(text: &str) -> Result<Self, DurationError> {
        let s = text.trim();
        if s.is_empty() {
            return Err(DurationError::Empty);
        }
        let text = || text.to_string();
        let bytes = s.as_bytes();
        let mut total: u128 = 0;
        let mut i = 0;
        while i < bytes.len() {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if start == i {
                return Err(DurationError::NoNumber { text: text(), position: start });
            }
            let number: u128 = s[start..i].parse().map_err(|_| DurationError::NumberTooLarge { text: text() })?;
            let unit_start = i;
            while i < bytes.len() && !bytes[i].is_ascii_digit() {
                i += 1;
            }
            let unit = &s[unit_start..i];
            let nanos_per_unit: u128 = match unit {
                "ns" => 1,
                "us" | "µs" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60 * 1_000_000_000,
                "h" => 3_600 * 1_000_000_000,
                "" => {
                    return Err(DurationError::MissingUnit { text: text() });
                }
                other => {
                    return Err(DurationError::UnknownUnit { text: text(), unit: other.to_string() });
                }
            };
            total = number
                .checked_mul(nanos_per_unit)
                .and_then(|n| total.checked_add(n))
                .ok_or_else(|| DurationError::TooLarge { text: text() })?;
        }
        let secs = u64::try_from(total / 1_000_000_000).map_err(|_| DurationError::TooLarge { text: text() })?;
        // The remainder is < 1e9 by construction, so the cast cannot truncate.
        let nanos = (total % 1_000_000_000) as u32;
        Ok(Self(Duration::new(secs, nanos)))
    }
}

impl fmt::Display for ConfigDuration {
    /// Prints the shortest exact form made of one unit: "10ms", "1m", "1500us".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.0.as_nanos();
        if nanos == 0 {
            return f.write_str("0s");
        }
        const UNITS: [(u128, &str); 6] = [
            (3_600_000_000_000, "h"),
            (60_000_000_000, "m"),
            (1_000_000_000, "s"),
            (1_000_000, "ms"),
            (1_000, "us"),
            (1, "ns"),
        ];
        for (per, unit) in UNITS {
            if nanos.is_multiple_of(per) {
                return write!(f, "{}{unit}", nanos / per);
            }
        }
        unreachable!("every duration is a whole number of nanoseconds")
    }
}

impl Serialize for ConfigDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ConfigDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ConfigDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"10ms\" or \"1s\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                ConfigDuration::parse(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_str(V)
    }
}

/// A byte count written as an integer of bytes or a string such as
/// `"100MiB"`. Units: `B`, `KiB`, `MiB`, `GiB`, `TiB`, and the TiKV-style
/// aliases `KB`, `MB`, `GB`, `TB` (also powers of 1024), in any case.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// `n` mebibytes (used for defaults).
    pub const fn mib(n: u64) -> Self {
        Self(n * 1024 * 1024)
    }

    /// The number of bytes.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Parses the string form; the error is a lowercase reason without the key.
    pub fn parse(text: &str) -> Result<Self, SizeError> {
        let s = text.trim();
        let text = || text.to_string();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        if number.is_empty() {
            return Err(SizeError::NoNumber { text: text() });
        }
        let number: u64 = number.parse().map_err(|_| SizeError::NumberTooLarge { text: text() })?;
        // Any case: "100mb" is what an operator means by "100MB".
        let shift = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "kib" | "kb" | "k" => 10,
            "mib" | "mb" | "m" => 20,
            "gib" | "gb" | "g" => 30,
            "tib" | "tb" | "t" => 40,
            _ => {
                let other = unit.trim();
                return Err(SizeError::UnknownUnit { text: text(), unit: other.to_string() });
            }
        };
        number.checked_mul(1u64 << shift).map(Self).ok_or_else(|| SizeError::TooLarge { text: text() })
    }
}

impl fmt::Display for ByteSize {
    /// Prints the largest exact binary unit: "100MiB", "1536KiB", "7B".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u32, &str); 4] = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
        for (shift, unit) in UNITS {
            if self.0 != 0 && self.0.is_multiple_of(1u64 << shift) {
                return write!(f, "{}{unit}", self.0 >> shift);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"100MiB\" or an integer number of bytes")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u64::try_from(v).map(ByteSize).map_err(|_| E::custom(format!("invalid size {v}: must not be negative")))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(ByteSize(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_every_documented_unit() {
        let ok = [
            ("500us", Duration::from_micros(500)),
            ("10ms", Duration::from_millis(10)),
            ("1s", Duration::from_secs(1)),
            ("1m", Duration::from_secs(60)),
            ("10m", Duration::from_secs(600)),
            ("1h", Duration::from_secs(3600)),
            ("1h30m", Duration::from_secs(5400)),
            ("250ns", Duration::from_nanos(250)),
        ];
        for (text, want) in ok {
            assert_eq!(ConfigDuration::parse(text).unwrap().0, want, "{text}");
        }
    }

    #[test]
    fn durations_reject_malformed_text() {
        for bad in [
            "10",
            "ms",
            "-1s",
            "1.5.s",
            "1.5s",
            "",
            "10 parsecs",
            "1d",
            "s10",
            "99999999999999999999999h",
            "18446744073709551616s",
        ] {
            assert!(ConfigDuration::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn durations_print_shortest_exact_unit_and_round_trip() {
        for text in ["10ms", "1m", "10m", "1h", "500us", "1500us", "90s"] {
            let d = ConfigDuration::parse(text).unwrap();
            assert_eq!(d.to_string(), text);
        }
        assert_eq!(ConfigDuration::parse("1h30m").unwrap().to_string(), "90m");
    }

    #[test]
    fn sizes_parse_units_and_print_largest_unit() {
        assert_eq!(ByteSize::parse("100MiB").unwrap(), ByteSize::mib(100));
        assert_eq!(ByteSize::parse("1GB").unwrap().0, 1 << 30);
        assert_eq!(ByteSize::parse("7").unwrap().0, 7);
        for same in ["100mb", "100 MB", "100mib", "100M", "100m"] {
            assert_eq!(ByteSize::parse(same).unwrap(), ByteSize::mib(100), "{same}");
        }
        assert_eq!(ByteSize::mib(100).to_string(), "100MiB");
        assert_eq!(ByteSize(1536 * 1024).to_string(), "1536KiB");
        assert_eq!(ByteSize(7).to_string(), "7B");
        for bad in ["", "MiB", "-1MiB", "1.5MiB", "10PiB", "10Mbit", "99999999999TiB"] {
            assert!(ByteSize::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
