//! Per-keyspace lists written as `"id:value,id:value"` strings, the seeds'
//! format for `keyspace-cpu-quotas`, `keyspace-estimated-cpu-per-request-us`
//! and `keyspace-burst-enabled`.
//!
//! The string form is kept in the file (operators of the original system know
//! it); it is read into a sorted map so a typo such as `"1:100,,2:3"` or a
//! duplicated keyspace id is refused instead of half-applied. Reading never
//! fails on its own: a malformed list keeps its text and why, and validation
//! reports it with the key's line, beside every other problem of the file.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A keyspace id, as carried in request contexts.
pub type KeyspaceId = u32;

/// A value allowed in a keyspace list: how to parse one entry and what makes
/// it acceptable.
pub trait ListValue: Copy + fmt::Display {
    /// Human description used in error messages ("a positive integer").
    const EXPECTED: &'static str;
    /// Parses one value; `None` means malformed or out of range.
    fn parse_value(text: &str) -> Option<Self>;
}

/// Millicores or microseconds: strictly positive integers. Zero is refused
/// because a zero quota or estimate would either block a keyspace forever or
/// make every request free; leaving the keyspace out expresses "no limit".
impl ListValue for u64 {
    const EXPECTED: &'static str = "a positive integer";
    fn parse_value(text: &str) -> Option<Self> {
        if !text.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        u64::from_str(text).ok().filter(|v| *v > 0)
    }
}

/// Per-keyspace switches: `true` or `false`, nothing else.
impl ListValue for bool {
    const EXPECTED: &'static str = "true or false";
    fn parse_value(text: &str) -> Option<Self> {
        match text {
            "true" => Some(true),
            "false" => Some(false),
            _ => None,
        }
    }
}

/// Why a keyspace list does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ListError {
    #[error("entry {position} is empty in {text:?}")]
    EmptyEntry { position: usize, text: String },
    #[error("entry {entry:?} is not \"keyspace_id:value\"")]
    NoColon { entry: String },
    #[error("entry {entry:?}: keyspace id {id:?} is not a u32")]
    BadId { entry: String, id: String },
    #[error("entry {entry:?}: value {value:?} is not {expected}")]
    BadValue { entry: String, value: String, expected: &'static str },
    #[error("keyspace {id} appears more than once")]
    Duplicate { id: KeyspaceId },
    /// More than one entry is wrong: each is said, in order.
    #[error("{} entries are wrong: {}", .0.len(), joined(.0))]
    Several(Vec<ListError>),
}

/// The errors' messages, in order, separated by "; ".
fn joined(errors: &[ListError]) -> String {
    errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// A parsed `"id:value,..."` list, sorted by keyspace id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyspaceList<T> {
    entries: BTreeMap<KeyspaceId, T>,
    /// As written and why it does not parse, for a list read from a file
    /// that validation refuses (a validated configuration holds none).
    malformed: Option<(String, ListError)>,
}

impl<T> Default for KeyspaceList<T> {
    fn default() -> Self {
        Self { entries: BTreeMap::new(), malformed: None }
    }
}

impl<T, const N: usize> From<[(KeyspaceId, T); N]> for KeyspaceList<T> {
    fn from(entries: [(KeyspaceId, T); N]) -> Self {
        Self { entries: entries.into(), malformed: None }
    }
}

impl<T: ListValue> KeyspaceList<T> {
    /// Parses the string form. The empty (or all-blank) string is the empty
    /// list; whitespace around entries is allowed; empty entries, missing
    /// ids or values, malformed values and duplicate ids are errors.
    pub fn parse(text: &str) -> Result<Self, ListError> {
        let mut entries = BTreeMap::new();
        if text.trim().is_empty() {
            return Ok(Self { entries, malformed: None });
        }
        // Every entry is read, so one reading names all that are wrong.
        let mut errors = Vec::new();
        for (index, raw) in text.split(',').enumerate() {
            match Self::entry(raw.trim(), index + 1, text) {
                Ok((id, value)) if entries.insert(id, value).is_some() => {
                    if !errors.contains(&ListError::Duplicate { id }) {
                        errors.push(ListError::Duplicate { id });
                    }
                }
                Ok(_) => {}
                Err(why) => errors.push(why),
            }
        }
        match errors.len() {
            0 => Ok(Self { entries, malformed: None }),
            1 => Err(errors.remove(0)),
            _ => Err(ListError::Several(errors)),
        }
    }

    /// One entry, `id:value`, the `position`th of `text`.
    fn entry(entry: &str, position: usize, text: &str) -> Result<(KeyspaceId, T), ListError> {
        if entry.is_empty() {
            return Err(ListError::EmptyEntry { position, text: text.to_string() });
        }
        let Some((id, value)) = entry.split_once(':') else {
            return Err(ListError::NoColon { entry: entry.to_string() });
        };
        let (id, value) = (id.trim(), value.trim());
        let id: KeyspaceId = id
            .parse()
            .ok()
            .filter(|_| id.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| ListError::BadId { entry: entry.to_string(), id: id.to_string() })?;
        let value = T::parse_value(value).ok_or_else(|| ListError::BadValue {
            entry: entry.to_string(),
            value: value.to_string(),
            expected: T::EXPECTED,
        })?;
        Ok((id, value))
    }

    /// The string form read as it is: parsed, or kept with why it does not
    /// parse ([`KeyspaceList::problem`]).
    pub fn read(text: &str) -> Self {
        Self::parse(text)
            .unwrap_or_else(|why| Self { entries: BTreeMap::new(), malformed: Some((text.to_string(), why)) })
    }

    /// Why the list as written does not parse, if it does not.
    pub fn problem(&self) -> Option<&ListError> {
        self.malformed.as_ref().map(|(_, why)| why)
    }

    /// The entries as a map, in keyspace-id order.
    pub fn map(&self) -> &BTreeMap<KeyspaceId, T> {
        &self.entries
    }

    /// Sets (or with `None` removes) the value of `id`.
    pub fn set(&mut self, id: KeyspaceId, value: Option<T>) {
        match value {
            Some(v) => self.entries.insert(id, v),
            None => self.entries.remove(&id),
        };
    }

    /// Lists no keyspace.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// The value configured for `id`, if any.
    pub fn get(&self, id: KeyspaceId) -> Option<T> {
        self.entries.get(&id).copied()
    }

    /// Entries in keyspace-id order.
    pub fn iter(&self) -> impl Iterator<Item = (KeyspaceId, T)> + '_ {
        self.entries.iter().map(|(k, v)| (*k, *v))
    }

    /// Number of keyspaces listed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no keyspace is listed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl<T: ListValue> fmt::Display for KeyspaceList<T> {
    /// The canonical string form, `"1:1000,2:2000"`, which parses back to the
    /// same list.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (id, value)) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{id}:{value}")?;
        }
        Ok(())
    }
}

impl<T: ListValue> Serialize for KeyspaceList<T> {
    /// The canonical form; a malformed list as it was written.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.malformed {
            Some((text, _)) => serializer.serialize_str(text),
            None => serializer.collect_str(self),
        }
    }
}

impl<'de, T: ListValue> Deserialize<'de> for KeyspaceList<T> {
    /// A string, read with [`KeyspaceList::read`] (anything else is a type
    /// error of the file).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self::read(&String::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wrong_entry_is_named_at_once() {
        let why = KeyspaceList::<u64>::parse("1:100,x:5,2:0,,1:7,3:300").unwrap_err();
        assert_eq!(
            why.to_string(),
            "4 entries are wrong: entry \"x:5\": keyspace id \"x\" is not a u32; entry \"2:0\": value \"0\" is not a \
             positive integer; entry 4 is empty in \"1:100,x:5,2:0,,1:7,3:300\"; keyspace 1 appears more than once"
        );
        // One wrong entry is said as it is.
        assert_eq!(
            KeyspaceList::<u64>::parse("1:100,2:0").unwrap_err().to_string(),
            "entry \"2:0\": value \"0\" is not a positive integer"
        );
    }

    #[test]
    fn quota_lists_parse_seed_samples() {
        let quotas = KeyspaceList::<u64>::parse("1:1000,2:2000").unwrap();
        assert_eq!(quotas.get(1), Some(1000));
        assert_eq!(quotas.get(2), Some(2000));
        assert_eq!(quotas.len(), 2);
        let burst = KeyspaceList::<bool>::parse("1:true, 2:false").unwrap();
        assert_eq!(burst.get(2), Some(false));
        assert!(KeyspaceList::<u64>::parse("").unwrap().is_empty());
        assert!(KeyspaceList::<u64>::parse("  ").unwrap().is_empty());
    }

    #[test]
    fn quota_lists_reject_malformed_entries() {
        for bad in [
            "1:",
            "x:100",
            "1:-5",
            "1:100,,2:3",
            "1:100,",
            "1",
            ":5",
            "1:0",
            "1:1.5",
            "1:100,1:200",
            "4294967296:1",
            "-1:5",
            "1:+5",
            "1:2:3",
        ] {
            assert!(KeyspaceList::<u64>::parse(bad).is_err(), "{bad:?} accepted");
        }
        for bad in ["1:yes", "1:1", "1:True", "2:true,2:false"] {
            assert!(KeyspaceList::<bool>::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn quota_lists_print_canonically() {
        let list = KeyspaceList::<u64>::parse(" 2:20 , 1:10").unwrap();
        assert_eq!(list.to_string(), "1:10,2:20");
        assert_eq!(KeyspaceList::<u64>::parse(&list.to_string()).unwrap(), list);
    }
}
