//! The context library (`handoffs mcp --context-library DIR`): project memory as plain Markdown
//! files that people can read, edit and commit. A record is a `.md` file with a small header
//! between `---` lines (`id`, `title`, `author`, `created`, `tags`, `status`, `supersedes`,
//! `superseded_by`); any other Markdown file in DIR counts as a record too, named by its path.
//!
//! The header is a hand-written subset of YAML (one `key: value` per line) on purpose: the
//! files must stay plain and diffable, and the subset is all we ever write.
//!
//! Records are authored by the server's fixed agent id; a tool never names the author. An id
//! from a tool is only ever compared with the ids found, never joined into a path.

use serde::Serialize;
use std::path::{Path, PathBuf};

mod corpus;
pub use corpus::{Entry, Put, Rule, value_from_text};

use crate::service::ServiceError;

pub const TITLE_MAX: usize = 200;
pub const BODY_MAX: usize = 100_000;
pub const TAGS_MAX: usize = 20;
pub const TAG_MAX: usize = 50;
pub const QUERY_MAX: usize = 500;
pub const BRIEF_DEFAULT: usize = 2_048;
pub const BRIEF_MAX: usize = 20_000;
/// Files larger than this are not read.
const FILE_MAX_BYTES: u64 = 1 << 20;
const DEPTH_MAX: usize = 4;
const FILES_MAX: usize = 5_000;

type Result<T> = std::result::Result<T, ServiceError>;

fn usage<T>(m: impl Into<String>) -> Result<T> {
    Err(ServiceError::Usage(m.into()))
}

/// One record.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Record {
    pub id: String,
    pub title: String,
    pub author: Option<String>,
    pub created: Option<String>,
    pub tags: Vec<String>,
    /// current or superseded.
    pub status: String,
    pub supersedes: Option<String>,
    pub superseded_by: Option<String>,
    /// The file, relative to the library.
    pub file: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// Header keys this library does not use (kept as they were when a record is rewritten).
    #[serde(skip)]
    pub other: Vec<(String, String)>,
}

/// A search hit.
#[derive(Clone, Debug, Serialize)]
pub struct Hit {
    pub id: String,
    pub title: String,
    pub author: Option<String>,
    pub status: String,
    pub score: u32,
    pub snippet: String,
}

/// The library's state.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    pub dir: String,
    pub records: usize,
    pub current: usize,
    pub superseded: usize,
    pub authors: Vec<String>,
    pub newest: Option<String>,
    pub bytes: u64,
}

/// A bounded brief of the current records.
#[derive(Clone, Debug, Serialize)]
pub struct Brief {
    pub text: String,
    pub included: usize,
    pub omitted: usize,
    pub truncated: bool,
}

/// The library in one folder.
#[derive(Clone, Debug)]
pub struct Library {
    dir: PathBuf,
}

fn check_title(t: &str) -> Result<()> {
    if t.trim().is_empty() {
        return usage("the title is empty");
    }
    if t.chars().count() > TITLE_MAX || t.contains('\n') {
        return usage(format!(
            "the title must be one line of at most {TITLE_MAX} characters"
        ));
    }
    Ok(())
}

fn check_body(b: &str) -> Result<()> {
    if b.trim().is_empty() {
        return usage("the body is empty");
    }
    if b.chars().count() > BODY_MAX {
        return usage(format!("the body is longer than {BODY_MAX} characters"));
    }
    Ok(())
}

fn check_tags(tags: &[String]) -> Result<()> {
    if tags.len() > TAGS_MAX {
        return usage(format!("at most {TAGS_MAX} tags"));
    }
    for t in tags {
        if t.is_empty()
            || t.chars().count() > TAG_MAX
            || !t.chars().all(|c| c.is_alphanumeric() || "-_.".contains(c))
        {
            return usage(format!(
                "a tag is 1 to {TAG_MAX} letters, digits, '-', '_' or '.'"
            ));
        }
    }
    Ok(())
}

/// Splits a file into its header fields and body.
fn parse(text: &str) -> (Vec<(String, String)>, &str) {
    // Editors on some systems start a file with a byte-order mark.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let rest = text
        .strip_prefix("---\n")
        .or_else(|| text.strip_prefix("---\r\n"));
    let Some(rest) = rest else {
        return (vec![], text);
    };
    let Some(end) = rest.find("\n---") else {
        return (vec![], text);
    };
    let header = &rest[..end];
    let after = &rest[end + 4..];
    let body = after
        .strip_prefix("\r\n")
        .or_else(|| after.strip_prefix('\n'))
        .unwrap_or(after);
    let fields = header
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.trim().to_owned(), v.trim().to_owned()))
        })
        .collect();
    (fields, body)
}

fn render(r: &Record, body: &str) -> String {
    let mut s = String::from("---\n");
    s.push_str(&format!("id: {}\n", r.id));
    s.push_str(&format!("title: {}\n", r.title));
    if let Some(a) = &r.author {
        s.push_str(&format!("author: {a}\n"));
    }
    if let Some(c) = &r.created {
        s.push_str(&format!("created: {c}\n"));
    }
    if !r.tags.is_empty() {
        s.push_str(&format!("tags: [{}]\n", r.tags.join(", ")));
    }
    s.push_str(&format!("status: {}\n", r.status));
    if let Some(x) = &r.supersedes {
        s.push_str(&format!("supersedes: {x}\n"));
    }
    if let Some(x) = &r.superseded_by {
        s.push_str(&format!("superseded_by: {x}\n"));
    }
    for (k, v) in &r.other {
        s.push_str(&format!("{k}: {v}\n"));
    }
    s.push_str("---\n");
    s.push_str(body);
    if !body.ends_with('\n') {
        s.push('\n');
    }
    s
}

fn record_of(rel: &str, text: &str) -> (Record, String) {
    let (fields, body) = parse(text);
    let get = |k: &str| {
        fields
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .filter(|v| !v.is_empty())
    };
    let stem = rel.strip_suffix(".md").unwrap_or(rel).to_owned();
    let title = get("title")
        .or_else(|| {
            body.lines()
                .find_map(|l| l.strip_prefix("# ").map(|t| t.trim().to_owned()))
        })
        .unwrap_or_else(|| stem.clone());
    let tags = get("tags")
        .map(|t| {
            t.trim_start_matches('[')
                .trim_end_matches(']')
                .split(',')
                .map(|x| x.trim().to_owned())
                .filter(|x| !x.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let superseded_by = get("superseded_by");
    let status = if superseded_by.is_some() || get("status").as_deref() == Some("superseded") {
        "superseded"
    } else {
        "current"
    };
    (
        Record {
            id: get("id").unwrap_or(stem),
            title,
            author: get("author"),
            created: get("created"),
            tags,
            status: status.to_owned(),
            supersedes: get("supersedes"),
            superseded_by,
            file: rel.to_owned(),
            body: None,
            other: fields
                .iter()
                .filter(|(k, _)| !KNOWN_KEYS.contains(&k.as_str()))
                .cloned()
                .collect(),
        },
        body.to_owned(),
    )
}

const KNOWN_KEYS: [&str; 8] = [
    "id",
    "title",
    "author",
    "created",
    "tags",
    "status",
    "supersedes",
    "superseded_by",
];

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// Writes `text` to `path` through a temporary file and a rename, so a reader never sees half.
fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    // Unique per write: two writers (even threads of one process) never share one.
    let tmp = path.with_extension(format!(
        "md.tmp{}-{}",
        std::process::id(),
        &crate::clock::new_id()[..8]
    ));
    // On disk before the rename: a power cut leaves the old file or the new, never an
    // empty one.
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

impl Library {
    /// The library in `dir` (created if missing).
    pub fn open(dir: &Path) -> Result<Library> {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(|e| {
                ServiceError::Refused(format!("cannot create {}: {e}", dir.display()))
            })?;
        }
        if !dir.is_dir() {
            return usage(format!("{} is not a folder", dir.display()));
        }
        Ok(Library {
            dir: std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned()),
        })
    }

    /// The library in `dir`, which must exist (a reader never creates a mistyped folder).
    pub fn open_existing(dir: &Path) -> Result<Library> {
        if !dir.is_dir() {
            return Err(ServiceError::NotFound(format!(
                "no context library at {}",
                dir.display()
            )));
        }
        Library::open(dir)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every record with its body, in file order.
    fn scan(&self) -> Result<Vec<(Record, String, u64)>> {
        let mut out = Vec::new();
        let mut stack = vec![(self.dir.clone(), 0usize)];
        while let Some((dir, depth)) = stack.pop() {
            let entries = std::fs::read_dir(&dir).map_err(|e| {
                ServiceError::Refused(format!("cannot read {}: {e}", dir.display()))
            })?;
            let mut entries: Vec<_> = entries.filter_map(std::result::Result::ok).collect();
            entries.sort_by_key(std::fs::DirEntry::file_name);
            for entry in entries {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    continue;
                }
                // symlink_metadata: links are never followed out of the library.
                let Ok(meta) = entry.path().symlink_metadata() else {
                    continue;
                };
                if meta.is_dir() && depth < DEPTH_MAX {
                    stack.push((entry.path(), depth + 1));
                } else if meta.is_file()
                    && Path::new(&name)
                        .extension()
                        .is_some_and(|e| e.eq_ignore_ascii_case("md"))
                    && meta.len() <= FILE_MAX_BYTES
                    && out.len() < FILES_MAX
                {
                    let Ok(text) = std::fs::read_to_string(entry.path()) else {
                        continue;
                    };
                    let rel = entry
                        .path()
                        .strip_prefix(&self.dir)
                        .map(|p| p.to_string_lossy().into_owned())
                        .unwrap_or(name);
                    let (r, body) = record_of(&rel, &text);
                    out.push((r, body, meta.len()));
                }
            }
        }
        Ok(out)
    }

    fn find(&self, id: &str) -> Result<(Record, String)> {
        if id.is_empty() || id.len() > crate::service::ID_CHARS_MAX {
            return usage("an id must be 1 to 200 characters");
        }
        self.scan()?
            .into_iter()
            .find(|(r, _, _)| r.id == id || r.file == id)
            .map(|(r, b, _)| (r, b))
            .ok_or_else(|| ServiceError::NotFound(format!("no record {id:?} in the library")))
    }

    pub fn get(&self, id: &str) -> Result<Record> {
        let (mut r, body) = self.find(id)?;
        r.body = Some(body);
        Ok(r)
    }

    /// Holds the library's lock file (`.lock`, hidden from records) until dropped.
    fn lock(&self) -> Result<std::fs::File> {
        let path = self.dir.join(".lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| ServiceError::Refused(format!("cannot open {}: {e}", path.display())))?;
        f.lock()
            .map_err(|e| ServiceError::Refused(format!("cannot lock {}: {e}", path.display())))?;
        Ok(f)
    }

    /// Writes a new record by `author`.
    pub fn record(
        &self,
        author: &str,
        title: &str,
        body: &str,
        tags: &[String],
        supersedes: Option<&str>,
    ) -> Result<Record> {
        let _lock = self.lock()?;
        self.write_record(author, title, body, tags, supersedes)
    }

    fn write_record(
        &self,
        author: &str,
        title: &str,
        body: &str,
        tags: &[String],
        supersedes: Option<&str>,
    ) -> Result<Record> {
        check_title(title)?;
        check_body(body)?;
        check_tags(tags)?;
        let id = crate::clock::new_id()[..12].to_owned();
        let r = Record {
            id: id.clone(),
            title: title.trim().to_owned(),
            author: Some(author.to_owned()),
            created: Some(now_rfc3339()),
            tags: tags.to_vec(),
            status: "current".to_owned(),
            supersedes: supersedes.map(str::to_owned),
            superseded_by: None,
            file: format!("{id}.md"),
            body: None,
            other: Vec::new(),
        };
        let path = self.dir.join(&r.file);
        write_atomic(&path, &render(&r, body))
            .map_err(|e| ServiceError::Refused(format!("cannot write {}: {e}", path.display())))?;
        Ok(r)
    }

    /// Replaces record `id` with a new one; the old one stays, marked superseded.
    pub fn supersede(
        &self,
        author: &str,
        id: &str,
        title: Option<&str>,
        body: &str,
        tags: Option<&[String]>,
    ) -> Result<Record> {
        // One writer at a time across processes: two supersedes of one record must not both
        // win (the check below and the rewrite are one step under this lock).
        let _lock = self.lock()?;
        let (old, old_body) = self.find(id)?;
        if old.status == "superseded" {
            return Err(ServiceError::Refused(format!(
                "record {id} is already superseded by {}",
                old.superseded_by.as_deref().unwrap_or("another record")
            )));
        }
        let title = title.unwrap_or(&old.title).to_owned();
        // The old record's tags carry over when they fit our rules; given tags must.
        let tags = match tags {
            Some(t) => t.to_vec(),
            None if check_tags(&old.tags).is_ok() => old.tags.clone(),
            None => Vec::new(),
        };
        let new = self.write_record(author, &title, body, &tags, Some(&old.id))?;
        let mut marked = old.clone();
        "superseded".clone_into(&mut marked.status);
        marked.superseded_by = Some(new.id.clone());
        let path = self.dir.join(&old.file);
        write_atomic(&path, &render(&marked, &old_body))
            .map_err(|e| ServiceError::Refused(format!("cannot write {}: {e}", path.display())))?;
        Ok(new)
    }

    /// Records matching every word of `query` (case-insensitive), best first.
    pub fn search(&self, query: &str, limit: usize, superseded: bool) -> Result<Vec<Hit>> {
        if query.trim().is_empty() || query.chars().count() > QUERY_MAX {
            return usage(format!("the query must be 1 to {QUERY_MAX} characters"));
        }
        if !(1..=100).contains(&limit) {
            return usage("limit must be 1 to 100");
        }
        let words: Vec<String> = query.split_whitespace().map(str::to_lowercase).collect();
        let mut hits: Vec<Hit> = self
            .scan()?
            .into_iter()
            .filter(|(r, _, _)| superseded || r.status == "current")
            .filter_map(|(r, body, _)| {
                let title = r.title.to_lowercase();
                let lower = body.to_lowercase();
                let tags = r.tags.join(" ").to_lowercase();
                let mut score = 0u32;
                for w in &words {
                    let t = u32::try_from(title.matches(w.as_str()).count()).unwrap_or(u32::MAX);
                    let b = u32::try_from(lower.matches(w.as_str()).count()).unwrap_or(u32::MAX);
                    let g = u32::from(tags.contains(w.as_str()));
                    if t + b + g == 0 {
                        return None;
                    }
                    score = score.saturating_add(t * 5 + g * 3 + b.min(20));
                }
                Some(Hit {
                    snippet: snippet(&body, &lower, &words[0]),
                    id: r.id,
                    title: r.title,
                    author: r.author,
                    status: r.status,
                    score,
                })
            })
            .collect();
        hits.sort_by(|a, b| b.score.cmp(&a.score).then_with(|| a.id.cmp(&b.id)));
        hits.truncate(limit);
        Ok(hits)
    }

    /// The current records, newest first, as a brief of at most `max_chars` characters.
    pub fn brief(&self, max_chars: usize) -> Result<Brief> {
        if !(200..=BRIEF_MAX).contains(&max_chars) {
            return usage(format!("max_chars must be 200 to {BRIEF_MAX}"));
        }
        let mut current: Vec<_> = self
            .scan()?
            .into_iter()
            .filter(|(r, _, _)| r.status == "current")
            .collect();
        current.sort_by(|a, b| b.0.created.cmp(&a.0.created).then(a.0.id.cmp(&b.0.id)));
        let mut text = String::new();
        let mut included = 0;
        let total = current.len();
        for (r, body, _) in &current {
            let first = body
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty() && !l.starts_with('#'))
                .unwrap_or("");
            let first: String = first.chars().take(160).collect();
            let line = format!(
                "- [{}] {} ({}{}): {}\n",
                r.id,
                r.title,
                r.author.as_deref().unwrap_or("unknown"),
                r.created
                    .as_deref()
                    .map(|c| format!(", {}", c.chars().take(10).collect::<String>()))
                    .unwrap_or_default(),
                first
            );
            if text.chars().count() + line.chars().count() > max_chars.saturating_sub(60) {
                break;
            }
            text.push_str(&line);
            included += 1;
        }
        let omitted = total - included;
        if omitted > 0 {
            text.push_str(&format!(
                "… {omitted} more records (context_search, context_get)\n"
            ));
        }
        if total == 0 {
            text.push_str("The library is empty: context_record adds the first record.\n");
        }
        Ok(Brief {
            text,
            included,
            omitted,
            truncated: omitted > 0,
        })
    }

    pub fn status(&self) -> Result<Status> {
        let all = self.scan()?;
        let mut authors: Vec<String> = all
            .iter()
            .filter_map(|(r, _, _)| r.author.clone())
            .collect();
        authors.sort();
        authors.dedup();
        let current = all.iter().filter(|(r, _, _)| r.status == "current").count();
        Ok(Status {
            dir: self.dir.display().to_string(),
            records: all.len(),
            current,
            superseded: all.len() - current,
            authors,
            newest: all.iter().filter_map(|(r, _, _)| r.created.clone()).max(),
            bytes: all.iter().map(|(_, _, n)| n).sum(),
        })
    }
}

/// About 200 characters of `body` around the first occurrence of `word`.
fn snippet(body: &str, lower: &str, word: &str) -> String {
    let at = lower.find(word).unwrap_or(0);
    // `lower` may differ in byte length from `body`; map through characters.
    let char_at = lower[..at.min(lower.len())].chars().count();
    let start = char_at.saturating_sub(80);
    let s: String = body.chars().skip(start).take(200).collect();
    let s = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if start > 0 { format!("…{s}") } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_search_supersede_brief() {
        let dir = tempfile::tempdir().unwrap();
        let lib = Library::open(dir.path()).unwrap();
        std::fs::write(
            dir.path().join("notes.md"),
            "# Old notes\nThe build uses make.\n",
        )
        .unwrap();
        let r = lib
            .record(
                "eng",
                "Flaky login test",
                "The login test fails under load.\nUse --retries.",
                &["ci".into()],
                None,
            )
            .unwrap();
        assert_eq!(r.author.as_deref(), Some("eng"));
        let hits = lib.search("LOGIN load", 10, false).unwrap();
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].id, r.id);
        let new = lib
            .supersede("rev", &r.id, None, "Fixed: the login test is stable.", None)
            .unwrap();
        assert_eq!(new.supersedes.as_deref(), Some(r.id.as_str()));
        let old = lib.get(&r.id).unwrap();
        assert_eq!(old.status, "superseded");
        assert_eq!(
            old.body.as_deref(),
            Some("The login test fails under load.\nUse --retries.\n")
        );
        assert!(lib.search("load", 10, false).unwrap().is_empty());
        assert_eq!(lib.search("load", 10, true).unwrap().len(), 1);
        let notes = lib.get("notes").unwrap();
        assert_eq!(notes.title, "Old notes");
        let b = lib.brief(200).unwrap();
        assert!(b.text.chars().count() <= 200, "{}", b.text);
        let s = lib.status().unwrap();
        assert_eq!((s.records, s.current, s.superseded), (3, 2, 1));
        assert!(lib.get("../etc/passwd").is_err());
        // Hand-written headers: non-ASCII dates, keys of their own (kept on rewrite), odd tags.
        std::fs::write(
            dir.path().join("jp.md"),
            "---\nid: jp\ntitle: T\ncreated: 2024年01月01日\nlayout: post\ntags: [a b]\n---\nbody\n",
        )
        .unwrap();
        assert!(lib.brief(2_000).unwrap().text.contains("[jp]"));
        lib.supersede("eng", "jp", None, "new body", None).unwrap();
        let jp = std::fs::read_to_string(dir.path().join("jp.md")).unwrap();
        assert!(
            jp.contains("layout: post") && jp.contains("superseded_by:"),
            "{jp}"
        );
        std::fs::write(
            dir.path().join("bom.md"),
            "\u{feff}---\nid: bom\nauthor: ann\n---\nbody\n",
        )
        .unwrap();
        assert_eq!(lib.get("bom").unwrap().author.as_deref(), Some("ann"));
        assert!(lib.record("eng", "two\nlines", "x", &[], None).is_err());
    }
}
