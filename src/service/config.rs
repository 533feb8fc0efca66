//! Configuration: the keys of SPEC §5 `config`, their defaults and checks.

use super::{Millis, Result, Service, ServiceError, Value, json, millis, usage};

const CONFIG_KEYS: [&str; 8] = [
    "enabled",
    "enabledAfter",
    "connections",
    "outageGuard",
    "chainHopBudget",
    "chainDepthLimit",
    "summaryCap",
    "topicSubscribersMax",
];

/// A new chain's hop budget and depth limit unless configured (SPEC §8.2).
pub const HOP_BUDGET_DEFAULT: i64 = 16;
pub const DEPTH_LIMIT_DEFAULT: i64 = 8;

fn check_config_key(key: &str) -> Result<()> {
    if CONFIG_KEYS.contains(&key) {
        Ok(())
    } else {
        usage(format!(
            "unknown config key {key:?}; keys: {}",
            CONFIG_KEYS.join(", ")
        ))
    }
}

fn config_default(key: &str) -> Value {
    match key {
        "enabled" => json!(true),
        "enabledAfter" => json!(0),
        "connections" => json!("open"),
        "chainHopBudget" => json!(HOP_BUDGET_DEFAULT),
        "chainDepthLimit" => json!(DEPTH_LIMIT_DEFAULT),
        "summaryCap" => json!(super::artifacts::SUMMARY_CAP_DEFAULT),
        "topicSubscribersMax" => json!(super::topics::SUBSCRIBERS_DEFAULT),
        _ => Value::Null,
    }
}

/// A moment given as milliseconds since the epoch or as an RFC 3339 time.
pub fn instant(raw: &str) -> Option<i64> {
    if let Ok(ms) = raw.parse::<i64>() {
        return (ms >= 0).then_some(ms);
    }
    humantime::parse_rfc3339_weak(raw)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .and_then(|d| i64::try_from(d.as_millis()).ok())
}

fn parse_config_value(key: &str, raw: &str, now: Millis) -> Result<Value> {
    match key {
        "enabled" => match raw {
            "true" | "on" | "1" => Ok(json!(true)),
            "false" | "off" | "0" => Ok(json!(false)),
            _ => usage("enabled takes true or false"),
        },
        "enabledAfter" => {
            if raw == "now" {
                return Ok(json!(millis(now)));
            }
            instant(raw).map(|ms| json!(ms)).ok_or_else(|| {
                    ServiceError::Usage(
                        "enabledAfter takes `now`, milliseconds since the epoch, or a time like 2026-11-29T12:00:00Z".to_owned(),
                    )
                })
        }
        "connections" => match raw {
            "open" | "explicit" => Ok(json!(raw)),
            _ => usage("connections takes open or explicit"),
        },
        "chainHopBudget" | "chainDepthLimit" => {
            let max = if key == "chainHopBudget" {
                super::chains::HOP_BUDGET_MAX
            } else {
                super::chains::DEPTH_LIMIT_MAX
            };
            raw.trim()
                .parse::<i64>()
                .ok()
                .filter(|n| (0..=max).contains(n))
                .map(|n| json!(n))
                .ok_or_else(|| ServiceError::Usage(format!("{key} takes a number from 0 to {max}")))
        }
        "summaryCap" => {
            use super::artifacts::{SUMMARY_CAP_MAX, SUMMARY_CAP_MIN};
            raw.trim()
                .parse::<i64>()
                .ok()
                .filter(|n| (SUMMARY_CAP_MIN..=SUMMARY_CAP_MAX).contains(n))
                .map(|n| json!(n))
                .ok_or_else(|| {
                    ServiceError::Usage(format!(
                        "summaryCap takes a number of bytes from {SUMMARY_CAP_MIN} to {SUMMARY_CAP_MAX}"
                    ))
                })
        }
        "topicSubscribersMax" => {
            use super::topics::SUBSCRIBERS_MAX;
            raw.trim()
                .parse::<i64>()
                .ok()
                .filter(|n| (1..=SUBSCRIBERS_MAX).contains(n))
                .map(|n| json!(n))
                .ok_or_else(|| {
                    ServiceError::Usage(format!(
                        "topicSubscribersMax takes a number from 1 to {SUBSCRIBERS_MAX}"
                    ))
                })
        }
        "outageGuard" => {
            let v: Value = serde_json::from_str(raw)
                .map_err(|e| ServiceError::Usage(format!("outageGuard takes JSON: {e}")))?;
            crate::adapter::outage::check_config(&v).map_err(ServiceError::Usage)?;
            Ok(v)
        }
        _ => usage(format!("unknown config key {key:?}")),
    }
}

impl Service {
    /// Every key with its value, the default where none was set.
    pub fn config(&mut self) -> Result<Vec<(String, Value)>> {
        self.store.read(|tx| {
            let mut out = Vec::new();
            for key in CONFIG_KEYS {
                out.push((
                    key.to_owned(),
                    tx.config(key)?.unwrap_or_else(|| config_default(key)),
                ));
            }
            Ok(out)
        })
    }

    pub fn config_get(&mut self, key: &str) -> Result<Value> {
        check_config_key(key)?;
        self.store
            .read(|tx| Ok(tx.config(key)?.unwrap_or_else(|| config_default(key))))
    }

    pub fn config_set(&mut self, key: &str, raw: &str) -> Result<Value> {
        check_config_key(key)?;
        let now = self.now();
        let value = parse_config_value(key, raw, now)?;
        self.store.write(|tx| {
            tx.set_config(key, &value)?;
            tx.event(millis(now), None, "config", &format!("{key} = {value}"))?;
            // A pause lifted or a connection rule changed: held deliveries are looked at now.
            tx.wake_pending(millis(now))?;
            Ok(value)
        })
    }
}
