//! The shared corpus (SPEC §8.2): keyed entries of the context library, each with a merge
//! rule that decides how concurrent writers combine: last-writer-wins (`lww`, the default,
//! the writer and time recorded; a write that names a version other than the current one is
//! refused as a conflict instead of overwriting), set-union (`set`), maximum (`max`) and
//! append-only log (`log`). Every write reads, merges and writes the entry under the
//! library's lock file, so writers in any number of processes never lose an update.
//!
//! An entry is a Markdown file in the library's hidden `.corpus/` folder, named by the
//! SHA-256 of its key (a key from a tool is never joined into a path): a header (`key`,
//! `rule`, `version`, `writer`, `updated`) and the value as pretty JSON, plain and diffable.

use super::{Library, Result, now_rfc3339, parse, usage, write_atomic};
use crate::service::ServiceError;
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// The longest key, in characters.
pub const KEY_MAX: usize = 200;
/// The longest member of a set, in characters.
pub const MEMBER_MAX: usize = 200;
/// The most members a set, or entries a log, holds.
pub const ITEMS_MAX: usize = 10_000;
/// The longest log entry, in characters.
pub const LOG_TEXT_MAX: usize = 4_000;

/// How concurrent writes to one key combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// The last write wins; a write naming a stale version is refused.
    Lww,
    /// Every member any writer added.
    Set,
    /// The largest number written.
    Max,
    /// Every entry, in the order written.
    Log,
}

impl std::str::FromStr for Rule {
    type Err = ServiceError;
    fn from_str(s: &str) -> Result<Rule> {
        match s {
            "lww" => Ok(Rule::Lww),
            "set" => Ok(Rule::Set),
            "max" => Ok(Rule::Max),
            "log" => Ok(Rule::Log),
            other => usage(format!(
                "unknown merge rule {other:?}: use lww, set, max or log"
            )),
        }
    }
}

impl Rule {
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Lww => "lww",
            Rule::Set => "set",
            Rule::Max => "max",
            Rule::Log => "log",
        }
    }
}

/// One keyed entry: a copy of it as it was read, with its version.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Entry {
    pub key: String,
    pub rule: Rule,
    /// 1 for its first write; each write that changes it adds one.
    pub version: u64,
    /// Who wrote it last, and when.
    pub writer: String,
    pub updated: String,
    /// A string (`lww`), an array of strings (`set`), a number (`max`), or an array of
    /// `{at, by, text}` (`log`).
    pub value: Value,
}

/// What a write did.
#[derive(Clone, Debug, Serialize)]
pub struct Put {
    pub entry: Entry,
    /// False when the write changed nothing (a member already in the set, a number below
    /// the maximum): the version stays.
    pub changed: bool,
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.chars().count() > KEY_MAX {
        return usage(format!("a key is 1 to {KEY_MAX} characters"));
    }
    if key.trim() != key || key.chars().any(char::is_control) {
        return usage("a key has no control characters and no space at either end");
    }
    Ok(())
}

/// The members a set write adds: one string, or an array of strings.
fn members(value: &Value) -> Result<Vec<String>> {
    let list: Vec<&Value> = match value {
        Value::Array(items) => items.iter().collect(),
        one => vec![one],
    };
    let mut out = Vec::with_capacity(list.len());
    for v in list {
        match v.as_str() {
            Some(m)
                if !m.trim().is_empty()
                    && m.chars().count() <= MEMBER_MAX
                    && !m.chars().any(char::is_control) =>
            {
                out.push(m.to_owned());
            }
            _ => {
                return usage(format!(
                    "a set's value is a string or an array of strings, each 1 to {MEMBER_MAX} \
                     characters on one line"
                ));
            }
        }
    }
    if out.is_empty() {
        return usage("a set write adds at least one member");
    }
    Ok(out)
}

/// Merges `value`, written by `writer` at `at`, into `current` by `rule`: the new value and
/// whether it changed.
fn merge(
    rule: Rule,
    current: Option<&Value>,
    value: &Value,
    (writer, at): (&str, &str),
) -> Result<(Value, bool)> {
    match rule {
        Rule::Lww => {
            let Some(text) = value.as_str() else {
                return usage("a last-writer-wins value is a string");
            };
            if text.chars().count() > super::BODY_MAX {
                return usage(format!(
                    "the value is longer than {} characters",
                    super::BODY_MAX
                ));
            }
            Ok((value.clone(), current != Some(value)))
        }
        Rule::Set => {
            let mut set: std::collections::BTreeSet<String> = current
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            let before = set.len();
            set.extend(members(value)?);
            if set.len() > ITEMS_MAX {
                return usage(format!("a set holds at most {ITEMS_MAX} members"));
            }
            let changed = current.is_none() || set.len() != before;
            Ok((Value::from(set.into_iter().collect::<Vec<_>>()), changed))
        }
        Rule::Max => {
            let Some(n) = value.as_f64().filter(|n| n.is_finite()) else {
                return usage("a max value is a finite number");
            };
            // Whole numbers compare as integers (an f64 loses them past 2^53).
            let below = match (current.and_then(Value::as_i64), value.as_i64()) {
                (Some(c), Some(v)) => Some(v <= c),
                _ => current.and_then(Value::as_f64).map(|c| n <= c),
            };
            match below {
                Some(true) => Ok((current.cloned().unwrap_or_default(), false)),
                _ => Ok((value.clone(), true)),
            }
        }
        Rule::Log => {
            let Some(text) = value.as_str().filter(|t| !t.trim().is_empty()) else {
                return usage("a log entry is a non-empty string");
            };
            if text.chars().count() > LOG_TEXT_MAX {
                return usage(format!("a log entry is at most {LOG_TEXT_MAX} characters"));
            }
            let mut log = current
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if log.len() >= ITEMS_MAX {
                return usage(format!("the log is full ({ITEMS_MAX} entries)"));
            }
            log.push(serde_json::json!({"at": at, "by": writer, "text": text}));
            Ok((Value::from(log), true))
        }
    }
}

fn render(e: &Entry) -> String {
    format!(
        "---\nkey: {}\nrule: {}\nversion: {}\nwriter: {}\nupdated: {}\n---\n{}\n",
        e.key,
        e.rule.as_str(),
        e.version,
        e.writer,
        e.updated,
        serde_json::to_string_pretty(&e.value).unwrap_or_default()
    )
}

fn entry_of(text: &str) -> Option<Entry> {
    let (fields, body) = parse(text);
    let get = |k: &str| {
        fields
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    Some(Entry {
        key: get("key")?,
        rule: get("rule")?.parse().ok()?,
        version: get("version")?.parse().ok()?,
        writer: get("writer").unwrap_or_default(),
        updated: get("updated").unwrap_or_default(),
        value: serde_json::from_str(body).ok()?,
    })
}

/// A value given as text (the CLI's words) for an entry merged by `rule`: one text (`lww`,
/// `log`), one number (`max`), or members (`set`).
pub fn value_from_text(rule: Rule, values: &[String]) -> Result<Value> {
    match (rule, values) {
        (Rule::Set, many) => Ok(Value::from(many.to_vec())),
        (Rule::Max, [one]) => one
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|n| n.is_finite())
            .and_then(|n| {
                // Whole numbers stay integers, as a JSON writer gave them.
                one.trim()
                    .parse::<i64>()
                    .map(Value::from)
                    .ok()
                    .or_else(|| serde_json::Number::from_f64(n).map(Value::Number))
            })
            .ok_or_else(|| ServiceError::Usage(format!("{one:?} is not a number (max)"))),
        (Rule::Lww | Rule::Log, [one]) => Ok(Value::from(one.as_str())),
        (rule, _) => usage(format!(
            "a {} entry takes one value (only a set takes several)",
            rule.as_str()
        )),
    }
}

impl Library {
    /// The rule a write to `key` merges by: the entry's own, else `given`, else `lww`.
    pub fn corpus_rule(&self, key: &str, given: Option<Rule>) -> Result<Rule> {
        check_key(key)?;
        Ok(self
            .read_entry(key)?
            .map(|e| e.rule)
            .or(given)
            .unwrap_or(Rule::Lww))
    }

    fn corpus_dir(&self) -> PathBuf {
        self.dir.join(".corpus")
    }

    fn entry_path(&self, key: &str) -> PathBuf {
        let name = hex::encode(Sha256::digest(key.as_bytes()));
        self.corpus_dir().join(format!("{}.md", &name[..32]))
    }

    fn read_entry(&self, key: &str) -> Result<Option<Entry>> {
        let path = self.entry_path(key);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(ServiceError::Refused(format!(
                    "cannot read {}: {e}",
                    path.display()
                )));
            }
        };
        match entry_of(&text) {
            Some(e) if e.key == key => Ok(Some(e)),
            _ => Err(ServiceError::Refused(format!(
                "the entry file {} for key {key:?} is damaged; fix or remove it",
                path.display()
            ))),
        }
    }

    /// A copy of the entry at `key`, with its version.
    pub fn corpus_get(&self, key: &str) -> Result<Entry> {
        check_key(key)?;
        self.read_entry(key)?
            .ok_or_else(|| ServiceError::NotFound(format!("no entry {key:?} in the corpus")))
    }

    /// Every entry (without its value), by key.
    pub fn corpus_list(&self) -> Result<Vec<Entry>> {
        let dir = self.corpus_dir();
        let Ok(files) = std::fs::read_dir(&dir) else {
            return Ok(Vec::new());
        };
        let mut out: Vec<Entry> = files
            .filter_map(std::result::Result::ok)
            .filter(|f| f.file_name().to_string_lossy().ends_with(".md"))
            .filter_map(|f| std::fs::read_to_string(f.path()).ok())
            .filter_map(|t| entry_of(&t))
            .map(|mut e| {
                e.value = Value::Null;
                e
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Writes `value` to `key` as `writer`, merged by the entry's rule (`rule` for a new
    /// entry, `lww` unless given; a given rule must match an existing entry's). Under
    /// last-writer-wins, `version` (the version the writer read) must be the current one, or
    /// the write is refused as a conflict that names the current version and its writer.
    pub fn corpus_put(
        &self,
        writer: &str,
        key: &str,
        value: &Value,
        rule: Option<Rule>,
        version: Option<u64>,
    ) -> Result<Put> {
        check_key(key)?;
        let held = self.lock()?;
        let current = self.read_entry(key)?;
        // The planted bug `corpus_unlocked`: the entry is read, then merged and written
        // after other writers had time to write theirs (as without the lock).
        if crate::planted(crate::Plant::CorpusUnlocked) {
            drop(held);
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let rule = match (&current, rule) {
            (Some(c), Some(r)) if c.rule != r => {
                return Err(ServiceError::Refused(format!(
                    "key {key:?} merges by {}, not {}",
                    c.rule.as_str(),
                    r.as_str()
                )));
            }
            (Some(c), _) => c.rule,
            (None, r) => r.unwrap_or(Rule::Lww),
        };
        if version.is_some() && rule != Rule::Lww {
            return usage(format!(
                "a version is for last-writer-wins entries; key {key:?} merges by {}, which \
                 loses no write",
                rule.as_str()
            ));
        }
        let now = current.as_ref().map_or(0, |c| c.version);
        if let Some(v) = version
            && rule == Rule::Lww
            && v != now
        {
            let by = current
                .as_ref()
                .map(|c| format!(", written by {} at {}", c.writer, c.updated))
                .unwrap_or_default();
            return Err(ServiceError::Refused(format!(
                "conflict: key {key:?} is at version {now}{by}, not {v}; read it again and \
                 write on the current version"
            )));
        }
        let at = now_rfc3339();
        let (merged, changed) = merge(
            rule,
            current.as_ref().map(|c| &c.value),
            value,
            (writer, &at),
        )?;
        if !changed && let Some(entry) = current {
            return Ok(Put {
                entry,
                changed: false,
            });
        }
        let entry = Entry {
            key: key.to_owned(),
            rule,
            version: now + 1,
            writer: writer.to_owned(),
            updated: at,
            value: merged,
        };
        let dir = self.corpus_dir();
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Refused(format!("cannot create {}: {e}", dir.display())))?;
        let path = self.entry_path(key);
        write_atomic(&path, &render(&entry))
            .and_then(|()| std::fs::File::open(&dir)?.sync_all())
            .map_err(|e| ServiceError::Refused(format!("cannot write {}: {e}", path.display())))?;
        Ok(Put {
            entry,
            changed: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Library, Rule};
    use serde_json::json;

    #[test]
    fn each_rule_merges_and_a_stale_lww_write_is_a_conflict() {
        let dir = tempfile::tempdir().unwrap();
        let lib = Library::open(dir.path()).unwrap();
        // Last writer wins, with the writer and the version.
        let p = lib
            .corpus_put("alice", "plan", &json!("v1"), None, None)
            .unwrap();
        assert_eq!((p.entry.version, p.entry.rule), (1, Rule::Lww));
        let p = lib
            .corpus_put("bob", "plan", &json!("v2"), None, Some(1))
            .unwrap();
        assert_eq!((p.entry.version, p.entry.writer.as_str()), (2, "bob"));
        let stale = lib
            .corpus_put("alice", "plan", &json!("v3"), None, Some(1))
            .unwrap_err()
            .to_string();
        assert!(
            stale.starts_with("conflict: key \"plan\" is at version 2, written by bob at "),
            "{stale}"
        );
        assert_eq!(lib.corpus_get("plan").unwrap().value, json!("v2"));
        // Set-union: members from every writer, each once.
        lib.corpus_put("a", "seen", &json!(["x", "y"]), Some(Rule::Set), None)
            .unwrap();
        let p = lib
            .corpus_put("b", "seen", &json!("y"), None, None)
            .unwrap();
        assert!(!p.changed, "y was there");
        lib.corpus_put("b", "seen", &json!("z"), None, None)
            .unwrap();
        assert_eq!(
            lib.corpus_get("seen").unwrap().value,
            json!(["x", "y", "z"])
        );
        // Max.
        lib.corpus_put("a", "best", &json!(3), Some(Rule::Max), None)
            .unwrap();
        assert!(
            !lib.corpus_put("b", "best", &json!(2), None, None)
                .unwrap()
                .changed
        );
        lib.corpus_put("b", "best", &json!(7.5), None, None)
            .unwrap();
        assert_eq!(lib.corpus_get("best").unwrap().value, json!(7.5));
        // Whole numbers past 2^53 stay exact.
        lib.corpus_put(
            "a",
            "big",
            &json!(9_007_199_254_740_992_i64),
            Some(Rule::Max),
            None,
        )
        .unwrap();
        let p = lib
            .corpus_put("b", "big", &json!(9_007_199_254_740_993_i64), None, None)
            .unwrap();
        assert!(p.changed);
        assert_eq!(p.entry.value, json!(9_007_199_254_740_993_i64));
        // Append-only log.
        lib.corpus_put("a", "notes", &json!("one"), Some(Rule::Log), None)
            .unwrap();
        lib.corpus_put("b", "notes", &json!("two"), None, None)
            .unwrap();
        let log = lib.corpus_get("notes").unwrap();
        assert_eq!(log.version, 2);
        let texts: Vec<&str> = log
            .value
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["text"].as_str().unwrap())
            .collect();
        assert_eq!(texts, ["one", "two"]);
        assert_eq!(log.value[1]["by"], "b");
        // A rule that does not match, a bad value, a bad key: refused, nothing written.
        let e = lib
            .corpus_put("a", "notes", &json!("x"), Some(Rule::Set), None)
            .unwrap_err();
        assert_eq!(e.to_string(), "key \"notes\" merges by log, not set");
        assert!(
            lib.corpus_put("a", "best", &json!("high"), None, None)
                .is_err()
        );
        assert!(
            lib.corpus_put("a", " padded", &json!("x"), None, None)
                .is_err()
        );
        assert!(lib.corpus_put("a", "", &json!("x"), None, None).is_err());
        // Entries are not records.
        assert_eq!(lib.status().unwrap().records, 0);
        let keys: Vec<String> = lib
            .corpus_list()
            .unwrap()
            .into_iter()
            .map(|e| e.key)
            .collect();
        assert_eq!(keys, ["best", "big", "notes", "plan", "seen"]);
    }
}
