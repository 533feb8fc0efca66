//! Bounded summaries (SPEC §8.2): a card carries at most the configured cap of a summary (2 KiB
//! unless `config summaryCap` says otherwise), cut on a character boundary with a visible
//! marker; the whole text is kept as an artifact the marker names, which the card's two agents
//! (and a person, on the CLI) fetch on demand.

use super::{Result, Service, ServiceError, Tx, check_agent_id, refused, usage};
use crate::store::ArtifactRow;

/// How many bytes of a summary a card carries unless configured.
pub const SUMMARY_CAP_DEFAULT: i64 = 2_048;
pub const SUMMARY_CAP_MIN: i64 = 256;
pub const SUMMARY_CAP_MAX: i64 = 65_536;

/// The configured cap, in bytes.
fn cap(tx: &Tx<'_>) -> Result<usize> {
    let n = tx
        .config("summaryCap")?
        .and_then(|v| v.as_i64())
        .unwrap_or(SUMMARY_CAP_DEFAULT)
        .clamp(SUMMARY_CAP_MIN, SUMMARY_CAP_MAX);
    Ok(usize::try_from(n).unwrap_or(2_048))
}

/// `text` as a card between `sender` and `recipient` may carry it: whole when it fits the
/// cap; else its first bytes up to the cap, cut on a character boundary, then a marker that
/// says how much was cut and names the artifact that keeps it all (stored here). Returns the
/// card's text and the artifact's id, if one was made.
pub(super) fn bounded(
    tx: &Tx<'_>,
    text: &str,
    kind: &str,
    (sender, recipient): (&str, &str),
    now: i64,
) -> Result<(String, Option<String>)> {
    let cap = cap(tx)?;
    if text.len() <= cap {
        return Ok((text.to_owned(), None));
    }
    let mut cut = cap;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let id = crate::clock::new_id();
    tx.insert_artifact(&ArtifactRow {
        id: id.clone(),
        kind: kind.to_owned(),
        sender: sender.to_owned(),
        recipient: recipient.to_owned(),
        body: text.to_owned(),
        created_at: now,
    })?;
    let more = text[cut..].chars().count();
    Ok((
        format!(
            "{}\n[… cut: {more} more characters. The whole text: `handoffs artifact get {id}` (MCP get_artifact)]",
            &text[..cut]
        ),
        Some(id),
    ))
}

impl Service {
    /// `text` as a card from `sender` to `recipient` may carry it ([`bounded`]), the whole
    /// kept as an artifact (in a transaction of its own) when it is cut.
    pub fn bounded_text(
        &mut self,
        text: &str,
        kind: &str,
        between: (&str, &str),
    ) -> Result<String> {
        let now = super::millis(self.now());
        self.store
            .write(|tx| Ok(bounded(tx, text, kind, between, now)?.0))
    }

    /// The artifact `id`; `as_agent` (an MCP session's agent) must be its card's sender or
    /// recipient. A person on the CLI reads any.
    pub fn artifact_get(&mut self, id: &str, as_agent: Option<&str>) -> Result<ArtifactRow> {
        if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return usage(format!(
                "invalid artifact id {:?}: the 32 hexadecimal digits its marker names",
                id.chars().take(80).collect::<String>()
            ));
        }
        if let Some(a) = as_agent {
            check_agent_id(a)?;
        }
        self.store.read(|tx| {
            let art = tx
                .artifact(id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no artifact {id}")))?;
            match as_agent {
                Some(a) if a != art.sender && a != art.recipient => refused(format!(
                    "artifact {id} belongs to {} and {}",
                    art.sender, art.recipient
                )),
                _ => Ok(art),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Service;

    /// A summary past the cap is cut on a character boundary, within the cap, with a marker
    /// naming its artifact; the artifact keeps it whole, for the card's two agents only.
    #[test]
    fn a_long_summary_is_cut_on_a_character_boundary_and_kept_whole() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("h.sqlite3");
        let (mut s, _) = Service::init(&db).unwrap();
        for a in ["lead", "dev", "other"] {
            s.add_agent(a, Some("demo"), None, None, None, &[]).unwrap();
        }
        s.config_set("summaryCap", "256").unwrap();
        let sent = s
            .send("lead", "dev", "do it", Some("t"), None, None)
            .unwrap();
        // 255 ASCII bytes, then two-byte characters: byte 256 falls inside one.
        let summary = format!("{}{}", "a".repeat(255), "é".repeat(400));
        let ret = s
            .return_work(&sent.message.id, "dev", &summary, None, false)
            .unwrap()
            .message
            .unwrap();
        let (shown, marker) = ret.body.split_once("\n[… cut: ").expect("a marker");
        let shown = shown
            .strip_prefix("Work returned: t\n\n")
            .expect("the card's head");
        assert_eq!(
            shown,
            "a".repeat(255),
            "cut before the character that crosses the cap"
        );
        assert!(marker.starts_with("400 more characters."), "{marker}");
        let id = marker
            .split("handoffs artifact get ")
            .nth(1)
            .and_then(|r| r.split('`').next())
            .expect("the artifact's id");
        assert_eq!(s.artifact_get(id, Some("lead")).unwrap().body, summary);
        assert_eq!(s.artifact_get(id, None).unwrap().body, summary);
        let refused = s.artifact_get(id, Some("other")).unwrap_err().to_string();
        assert_eq!(refused, format!("artifact {id} belongs to dev and lead"));
        // A summary within the cap is carried whole, with no artifact.
        let sent = s
            .send("lead", "dev", "again", Some("t2"), None, None)
            .unwrap();
        let ret = s
            .return_work(&sent.message.id, "dev", "short", Some("the log"), false)
            .unwrap()
            .message
            .unwrap();
        assert_eq!(ret.body, "Work returned: t2\n\nshort\n\nEvidence: the log");
    }
}
