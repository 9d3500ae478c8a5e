//! Where each key sits in the source text.
//!
//! serde reports a byte span for syntax and type errors but knows nothing of
//! lines or dotted keys, and semantic validation runs after parsing when spans
//! are gone. [`SourceMap`] closes both gaps with one line scan of the file:
//! it maps dotted keys to lines and lines back to dotted keys.

use super::error::ConfigError;

/// Dotted keys (and table headers) with the 1-based line they appear on.
#[derive(Clone, Debug, Default)]
pub struct SourceMap {
    /// `(line, dotted key, is_table_header)`, in file order.
    entries: Vec<(usize, String, bool)>,
    /// Byte offset at which each line starts.
    line_starts: Vec<usize>,
    /// Keys whose value is an inline table (`key = { ... }`).
    inline_tables: Vec<String>,
    /// `(line, value as written)` of each key on one line.
    values: Vec<(usize, String)>,
}

impl SourceMap {
    /// An empty map, for configurations that did not come from a file.
    pub fn none() -> Self {
        Self::default()
    }

    /// Scans `source` once.
    pub fn new(source: &str) -> Self {
        let mut entries = Vec::new();
        let mut inline_tables = Vec::new();
        let mut values = Vec::new();
        let mut line_starts = vec![0];
        let mut table = String::new();
        let mut in_multiline: Option<&str> = None;
        // Where each element of an array of tables (`[[rules]]`) starts.
        let mut elements = Vec::new();
        for (i, line) in source.split('\n').enumerate() {
            line_starts.push(line_starts[i] + line.len() + 1);
            let number = i + 1;
            let text = line.trim();
            if let Some(delim) = in_multiline {
                if text.contains(delim) {
                    in_multiline = None;
                }
                continue;
            }
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            if text.starts_with('[') {
                let inner = text.trim_start_matches('[');
                let inner = inner.split(']').next().unwrap_or_default();
                table = normalize(inner);
                if text.starts_with("[[") {
                    elements.push(entries.len());
                }
                entries.push((number, table.clone(), true));
                continue;
            }
            let Some((key, value)) = text.split_once('=') else {
                continue;
            };
            if !key.chars().all(|c| c.is_alphanumeric() || "-_.\"' ".contains(c)) {
                continue;
            }
            let key = normalize(key);
            let full = if table.is_empty() { key } else { format!("{table}.{key}") };
            if value.trim_start().starts_with('{') {
                inline_tables.push(full.clone());
            }
            entries.push((number, full, false));
            values.push((number, value.trim().to_string()));
            for delim in ["\"\"\"", "'''"] {
                if value.matches(delim).count() == 1 {
                    in_multiline = Some(delim);
                }
            }
        }
        name_elements(&mut entries, &values, &elements);
        Self { entries, line_starts, inline_tables, values }
    }

    /// The line of the last definition of `dotted` (a key or a table).
    pub fn line_of(&self, dotted: &str) -> Option<usize> {
        self.entries.iter().rev().find(|(_, k, _)| k == dotted).map(|(l, _, _)| *l)
    }

    /// The 1-based line containing byte `offset`.
    pub fn line_of_offset(&self, offset: usize) -> usize {
        self.line_starts.partition_point(|start| *start <= offset).max(1)
    }

    /// The dotted key defined on `line`, or the table header on it.
    pub fn key_at_line(&self, line: usize) -> Option<&str> {
        self.entries.iter().find(|(l, _, _)| *l == line).map(|(_, k, _)| k.as_str())
    }

    /// The table in effect at `line` ("" for the root table).
    pub fn table_at_line(&self, line: usize) -> &str {
        self.entries.iter().rev().find(|(l, _, header)| *header && *l <= line).map(|(_, k, _)| k.as_str()).unwrap_or("")
    }

    /// The line and key of `table`'s own key whose value is the string
    /// `value`.
    fn key_with_value(&self, table: &str, value: &str) -> Option<(usize, &str)> {
        let quoted = [format!("\"{value}\""), format!("'{value}'")];
        self.values.iter().find_map(|(l, v)| {
            let (_, key, _) = self.entries.iter().find(|(el, _, h)| el == l && !h)?;
            let own = key.strip_prefix(table)?.strip_prefix('.').is_some_and(|rest| !rest.contains('.'));
            let holds = quoted.iter().any(|q| v.split('#').next().unwrap_or_default().trim() == q);
            (own && holds).then_some((*l, key.as_str()))
        })
    }

    /// The name validation gives the element of the array of tables `table`
    /// whose header or key is on `line`: `table.NAME` when it has a name,
    /// else `table[i]`; `None` outside such an element.
    fn element_at_line(&self, table: &str, line: usize) -> Option<String> {
        let header = self.entries.iter().rev().find(|(l, _, h)| *h && *l <= line)?.0;
        let aliases: Vec<&str> = self
            .entries
            .iter()
            .filter(|(l, k, h)| *l == header && !h && k.len() > table.len() && k.starts_with(table))
            .map(|(_, k, _)| k.as_str())
            .collect();
        let named = aliases.iter().find(|k| k[table.len()..].starts_with('.'));
        named.or(aliases.first()).map(|k| k.to_string())
    }

    /// Turns a toml/serde error into a [`ConfigError`] naming key and line.
    pub fn convert(&self, error: &toml::de::Error) -> ConfigError {
        self.convert_at(error, error.span().map(|span| self.line_of_offset(span.start)))
    }

    /// [`Self::convert`] of an error at `line` of this file (found in a copy
    /// of it with lines blanked: the lines keep their numbers, the keys and
    /// elements are this file's).
    pub fn convert_at(&self, error: &toml::de::Error, line: Option<usize>) -> ConfigError {
        let message = error.message().trim().replace('\n', "; ");
        if let Some(field) = message.strip_prefix("unknown field `").and_then(|rest| rest.split('`').next()) {
            let table = line.map(|l| self.table_at_line(l)).unwrap_or("");
            // The span may point at the key or at its table; prefer the key's line.
            let table = match line.and_then(|l| self.key_at_line(l)) {
                Some(k) if k.ends_with(&format!(".{field}")) || k == field => {
                    k.strip_suffix(field).unwrap_or("").trim_end_matches('.')
                }
                // A table header naming the unknown key on its path
                // (`[multitenancy.admission_control]` with `multitenancy`
                // unknown): the key is the path up to it.
                Some(k) if self.entries.iter().any(|(_, e, h)| *h && e == k) => {
                    let parts: Vec<&str> = k.split('.').collect();
                    match parts.iter().position(|p| *p == field) {
                        Some(i) => {
                            let key = parts[..=i].join(".");
                            let line = self.line_of(&key).or(line);
                            return ConfigError::UnknownKey { key, line };
                        }
                        None => k,
                    }
                }
                Some(k) if self.inline_tables.iter().any(|t| t == k) => k,
                _ => table,
            };
            // In an element of an array of tables, by the element's name.
            let table = line.and_then(|l| self.element_at_line(table, l)).unwrap_or_else(|| table.to_string());
            let key = if table.is_empty() { field.to_string() } else { format!("{table}.{field}") };
            let line = self.line_of(&key).or(line);
            return ConfigError::UnknownKey { key, line };
        }
        // A key an element of an array of tables lacks: named by the element.
        if let (Some(l), Some(field)) =
            (line, message.strip_prefix("missing field `").and_then(|rest| rest.split('`').next()))
            && let Some(element) = self.key_at_line(l).and_then(|table| self.element_at_line(table, l))
        {
            return ConfigError::Syntax { key: format!("{element}.{field}"), line, message };
        }
        // A value no variant matches is reported at its table: the key is
        // the table's one holding that value.
        if let (Some(l), Some(bad)) =
            (line, message.strip_prefix("unknown variant `").and_then(|rest| rest.split('`').next()))
            && let Some(table) = self.entries.iter().find(|(el, _, h)| *h && *el == l).map(|(_, k, _)| k.as_str())
            && let Some((kl, key)) = self.key_with_value(table, bad)
        {
            return ConfigError::Syntax { key: key.to_string(), line: Some(kl), message };
        }
        let key = line.and_then(|l| self.key_at_line(l)).map(str::to_string).unwrap_or_else(|| "<file>".to_string());
        ConfigError::Syntax { key, line, message }
    }
}

/// Gives the keys of each element of an array of tables the names
/// validation gives them: `rules[i].key` by position, and `rules.NAME.key`
/// by the element's `name` (a later element of the same name is the one
/// found). Added as plain keys after the rest, so the lookups by line still
/// find the keys as written first.
fn name_elements(entries: &mut Vec<(usize, String, bool)>, values: &[(usize, String)], starts: &[usize]) {
    let mut seen: Vec<&str> = Vec::new();
    let mut aliases = Vec::new();
    for &start in starts {
        let table = entries[start].1.as_str();
        let index = seen.iter().filter(|t| **t == table).count();
        seen.push(table);
        let end =
            entries[start + 1..].iter().position(|(_, _, header)| *header).map_or(entries.len(), |n| start + 1 + n);
        let block = &entries[start..end];
        let name =
            block.iter().find(|(_, k, h)| !h && k.strip_prefix(table) == Some(".name")).and_then(|(line, _, _)| {
                let (_, v) = values.iter().find(|(l, _)| l == line)?;
                let v = v.split('#').next().unwrap_or_default().trim();
                Some(v.trim_matches('"').trim_matches('\'').to_string())
            });
        for (line, key, _) in block {
            let rest = key.strip_prefix(table).unwrap_or_default();
            aliases.push((*line, format!("{table}[{index}]{rest}"), false));
            if let Some(name) = &name {
                aliases.push((*line, format!("{table}.{name}{rest}"), false));
            }
        }
    }
    entries.extend(aliases);
}

/// `a . "b" .c` → `a.b.c`.
fn normalize(key: &str) -> String {
    key.split('.').map(|part| part.trim().trim_matches('"').trim_matches('\'')).collect::<Vec<_>>().join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "# comment\n[resource-control]\nenabled = true\n\n[resource-control.cpu-throttle]\nrefill-interval = \"10ms\"\n\"burst-window\" = \"100ms\"\n[agent]\ntimer-period = \"1ms\"\n";

    #[test]
    fn keys_map_to_lines_and_back() {
        let map = SourceMap::new(SAMPLE);
        assert_eq!(map.line_of("resource-control.enabled"), Some(3));
        assert_eq!(map.line_of("resource-control.cpu-throttle.refill-interval"), Some(6));
        assert_eq!(map.line_of("resource-control.cpu-throttle.burst-window"), Some(7));
        assert_eq!(map.line_of("agent.timer-period"), Some(9));
        assert_eq!(map.line_of("agent.max-threads"), None);
        assert_eq!(map.key_at_line(8), Some("agent"));
        assert_eq!(map.table_at_line(7), "resource-control.cpu-throttle");
    }

    #[test]
    fn an_unknown_table_on_a_header_path_is_named_as_written() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Root {
            agent: Option<std::collections::BTreeMap<String, i64>>,
        }
        for (text, want) in [
            ("[multitenancy.admission_control]\nmode = 1\n", "line 1: multitenancy: unknown key"),
            ("[agent]\nx = 1\n[multitenancy]\nmode = 1\n", "line 3: multitenancy: unknown key"),
        ] {
            let e = toml::from_str::<Root>(text).unwrap_err();
            assert_eq!(SourceMap::new(text).convert(&e).to_string(), want, "{text:?}");
        }
    }

    #[test]
    fn offsets_map_to_lines() {
        let map = SourceMap::new("a = 1\nb = 2\n");
        assert_eq!(map.line_of_offset(0), 1);
        assert_eq!(map.line_of_offset(5), 1);
        assert_eq!(map.line_of_offset(6), 2);
    }

    #[test]
    fn the_keys_of_each_rule_are_found_by_its_name_and_its_position() {
        let text = "[agent]\nx = 1\n\n[[rules]]\nkeyspace = 1\nname = \"a\"\n\n[[rules]]\nname = 'b' # the second\nuid = 0\n\n[[rules]]\nname = \"a\"\ncgroup = \"/x\"\n[agent.more]\ny = 2\n";
        let map = SourceMap::new(text);
        assert_eq!(map.line_of("rules.b.uid"), Some(10));
        assert_eq!(map.line_of("rules.b"), Some(8));
        assert_eq!(map.line_of("rules[0].keyspace"), Some(5));
        assert_eq!(map.line_of("rules[2]"), Some(12));
        // Two rules named "a": the later one, as a duplicate's error wants.
        assert_eq!(map.line_of("rules.a.name"), Some(13));
        assert_eq!(map.line_of("rules.a.keyspace"), Some(5));
        assert_eq!(map.line_of("rules.b.y"), None);
        assert_eq!(map.line_of("agent.more.y"), Some(16));
        // Lines still lead to the keys as written.
        assert_eq!(map.key_at_line(10), Some("rules.uid"));
        assert_eq!(map.table_at_line(10), "rules");
    }

    #[test]
    fn dotted_keys_inside_a_table_are_prefixed() {
        let map = SourceMap::new("[resource-control]\ncpu-throttle.enabled = true\n");
        assert_eq!(map.line_of("resource-control.cpu-throttle.enabled"), Some(2));
    }
}
