//! Configuration and the engine's report.

use super::{OptionalExtension, Result, Tx, Value, params};

impl Tx<'_> {
    pub fn config(&self, key: &str) -> Result<Option<Value>> {
        self.remembered(
            |m| &mut m.config,
            key.to_owned(),
            || {
                let v: Option<String> = self
                    .row("SELECT value FROM config WHERE key = ?1", [key], |r| {
                        r.get(0)
                    })
                    .optional()?;
                Ok(v.and_then(|s| serde_json::from_str(&s).ok()))
            },
        )
    }

    pub fn set_config(&self, key: &str, value: &Value) -> Result<()> {
        self.exec(
            "INSERT INTO config (key, value) VALUES (?1, ?2)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![key, value.to_string()],
        )?;
        Ok(())
    }

    pub fn save_report(&self, at: i64, report: &Value) -> Result<()> {
        self.exec(
            "INSERT INTO engine (id, at, report) VALUES (1, ?1, ?2)
             ON CONFLICT (id) DO UPDATE SET at = excluded.at, report = excluded.report",
            params![at, report.to_string()],
        )?;
        Ok(())
    }

    pub fn report(&self) -> Result<Option<(i64, Value)>> {
        let row: Option<(i64, String)> = self
            .row("SELECT at, report FROM engine WHERE id = 1", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()?;
        Ok(row.map(|(at, s)| (at, serde_json::from_str(&s).unwrap_or(Value::Null))))
    }
}
