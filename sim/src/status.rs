//! A simulated provider status page (Statuspage `summary.json`), for the engine's outage
//! guard. The runner flips it; the oracle keeps when it was flipped.

use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The page and the outages it reported: (from, until; None while it lasts).
#[derive(Debug, Default)]
pub struct StatusPage {
    pub outage: bool,
    pub windows: Vec<(Duration, Option<Duration>)>,
}

pub type Page = Arc<Mutex<StatusPage>>;

impl StatusPage {
    pub fn set(&mut self, outage: bool, at: Duration) {
        if outage == self.outage {
            return;
        }
        self.outage = outage;
        if outage {
            self.windows.push((at, None));
        } else if let Some(last) = self.windows.last_mut() {
            last.1 = Some(at);
        }
    }
}

/// The status host's software.
///
/// # Errors
/// When the server cannot listen.
pub async fn host(page: Page) -> Result<(), Box<dyn std::error::Error>> {
    crate::net::serve(move |_req| {
        let outage = page
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .outage;
        let (indicator, description) = if outage {
            ("major", "Major outage (simulated)")
        } else {
            ("none", "All systems operational")
        };
        (
            200,
            json!({"status": {"indicator": indicator, "description": description}}).to_string(),
        )
    })
    .await
}
