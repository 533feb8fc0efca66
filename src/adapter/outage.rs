//! The outage guard (SPEC §5 `config outageGuard`): polls a Statuspage-style `summary.json`
//! with a timeout and a cache, and fails open (an unreachable status page is no outage).

use super::http::Http;
use serde_json::Value;
use std::cell::RefCell;
use std::time::Duration;
use tokio::time::Instant;

const CACHE: Duration = Duration::from_secs(60);
const TIMEOUT: Duration = Duration::from_secs(5);

const OPENAI: &str = "https://status.openai.com/api/v2/summary.json";
const ANTHROPIC: &str = "https://status.anthropic.com/api/v2/summary.json";

/// Status pages of the common providers: `(name, summary URL, components watched)`; no
/// components: the page's overall indicator. The product names (`openai-codex`, `codex`,
/// `anthropic-claude-code`, `claude-code`) are the ones users already have in their configs;
/// a `components` list in the config overrides a preset's.
pub const PRESETS: [(&str, &str, &[&str]); 7] = [
    ("openai", OPENAI, &[]),
    ("openai-codex", OPENAI, &["Codex"]),
    ("codex", OPENAI, &["Codex"]),
    ("anthropic", ANTHROPIC, &[]),
    ("anthropic-claude-code", ANTHROPIC, &["Claude Code"]),
    ("claude-code", ANTHROPIC, &["Claude Code"]),
    (
        "github",
        "https://www.githubstatus.com/api/v2/summary.json",
        &[],
    ),
];

fn preset(name: &str) -> Option<(&'static str, &'static [&'static str])> {
    PRESETS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, url, components)| (*url, *components))
}

/// Checks an `outageGuard` value: `null`, `{"preset": NAME}`, or `{"url", "components"?}`.
pub fn check_config(v: &Value) -> Result<(), String> {
    if v.is_null() {
        return Ok(());
    }
    let obj = v
        .as_object()
        .ok_or("outageGuard takes null, {\"preset\": NAME} or {\"url\": …, \"components\": […]}")?;
    if let Some(p) = obj.get("preset") {
        let name = p.as_str().unwrap_or_default();
        if preset(name).is_none() {
            let names: Vec<&str> = PRESETS.iter().map(|(n, _, _)| *n).collect();
            return Err(format!("unknown preset {p}; presets: {}", names.join(", ")));
        }
        return check_components(obj.get("components"));
    }
    let url = obj
        .get("url")
        .and_then(Value::as_str)
        .ok_or("outageGuard needs a preset or a url")?;
    reqwest::Url::parse(url).map_err(|e| format!("outageGuard url: {e}"))?;
    check_components(obj.get("components"))
}

fn check_components(components: Option<&Value>) -> Result<(), String> {
    if let Some(c) = components
        && !c.as_array().is_some_and(|a| a.iter().all(Value::is_string))
    {
        return Err("outageGuard components must be a list of component names".to_owned());
    }
    Ok(())
}

/// The guard's cached view: the page it read (and what it watched there), when, and its
/// verdict. Shared by the engine's jobs; never borrowed across an `.await` (two jobs may
/// both refresh; both verdicts are fresh).
#[derive(Debug, Default)]
pub struct OutageGuard {
    cached: RefCell<Option<(Instant, String, Option<String>)>>,
}

impl OutageGuard {
    /// The outage the status page reports for `config`, if any.
    pub async fn check(&self, http: &Http, config: &Value) -> Option<String> {
        if config.is_null() {
            return None;
        }
        let (url, preset_components) = match config.get("preset").and_then(Value::as_str) {
            Some(name) => {
                let (url, components) = preset(name)?;
                (url.to_owned(), Value::from(components.to_vec()))
            }
            None => (config.get("url")?.as_str()?.to_owned(), Value::Null),
        };
        let components = config.get("components").unwrap_or(&preset_components);
        // The verdict depends on the page and on what is watched on it.
        let key = format!("{url} {components}");
        if let Some((at, cached, verdict)) = &*self.cached.borrow()
            && *cached == key
            && at.elapsed() < CACHE
        {
            return verdict.clone();
        }
        let verdict = match http.get(&url, TIMEOUT).await {
            Ok(r) if r.is_success() => match r.json() {
                Ok(summary) => judge(&summary, Some(components)),
                Err(_) => None,
            },
            _ => None,
        };
        *self.cached.borrow_mut() = Some((Instant::now(), key, verdict.clone()));
        verdict
    }
}

/// Reads a Statuspage summary: an outage when a watched component (or, with none named, the
/// page's overall indicator) is not operational. A page that lists none of the watched
/// components (renamed, or a preset's guess that no longer holds) is judged by its overall
/// indicator, never taken for a page without outages.
pub fn judge(summary: &Value, components: Option<&Value>) -> Option<String> {
    let watched: Vec<&str> = components
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let listed = summary
        .get("components")
        .and_then(Value::as_array)
        .is_some_and(|list| {
            list.iter().any(|c| {
                c.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| watched.contains(&n))
            })
        });
    if watched.is_empty() || !listed {
        let indicator = summary.pointer("/status/indicator")?.as_str()?;
        return matches!(indicator, "major" | "critical").then(|| {
            let d = summary
                .pointer("/status/description")
                .and_then(Value::as_str)
                .unwrap_or(indicator);
            format!("status page: {d}")
        });
    }
    let list = summary.get("components")?.as_array()?;
    let down: Vec<String> = list
        .iter()
        .filter(|c| {
            c.get("name")
                .and_then(Value::as_str)
                .is_some_and(|n| watched.contains(&n))
        })
        .filter(|c| {
            c.get("status")
                .and_then(Value::as_str)
                .is_some_and(|s| matches!(s, "major_outage" | "partial_outage"))
        })
        .filter_map(|c| {
            Some(format!(
                "{} {}",
                c.get("name")?.as_str()?,
                c.get("status")?.as_str()?
            ))
        })
        .collect();
    (!down.is_empty()).then(|| format!("status page: {}", down.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_watched_component_in_major_outage_is_an_outage() {
        let summary = json!({"status": {"indicator": "minor"}, "components": [
            {"name": "API", "status": "major_outage"}, {"name": "Chat", "status": "operational"}]});
        assert_eq!(
            judge(&summary, Some(&json!(["API"]))).as_deref(),
            Some("status page: API major_outage")
        );
        assert_eq!(judge(&summary, Some(&json!(["Chat"]))), None);
        assert_eq!(
            judge(&summary, None),
            None,
            "minor overall is not an outage"
        );
    }

    #[test]
    fn a_page_without_the_watched_component_is_judged_as_a_whole() {
        let summary = json!({"status": {"indicator": "major", "description": "Major outage"},
            "components": [{"name": "API", "status": "major_outage"}]});
        assert_eq!(
            judge(&summary, Some(&json!(["Codex"]))).as_deref(),
            Some("status page: Major outage")
        );
    }

    #[test]
    fn bad_guard_configs_are_refused() {
        assert!(check_config(&json!({"preset": "nope"})).is_err());
        assert!(check_config(&json!({"url": 3})).is_err());
        assert!(check_config(&json!({"preset": "openai"})).is_ok());
        assert!(check_config(&json!({"preset": "openai-codex"})).is_ok());
        assert!(check_config(&json!({"preset": "claude-code", "components": "API"})).is_err());
        assert!(check_config(&Value::Null).is_ok());
    }
}
