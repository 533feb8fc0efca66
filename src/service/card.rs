//! The text a recipient sees (SPEC §2.5): who sent it, the title and due time, the message
//! quoted, and the one next step, naming the CLI command and the MCP tool.

use crate::store::{MessageRow, WorkRow};

fn quote(body: &str) -> String {
    body.lines()
        .map(|l| {
            if l.is_empty() {
                ">".to_owned()
            } else {
                format!("> {l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

use crate::text::when;

/// The card for `message` (with its work contract, if any).
pub fn card(message: &MessageRow, work: Option<&WorkRow>) -> String {
    let id = &message.id;
    let short = crate::text::short(id);
    let mut out = String::new();
    match (message.kind.as_str(), work) {
        ("work", Some(w)) => {
            out.push_str(&format!("Work from {}: {}\n", message.sender, w.title));
            if let Some(due) = w.due_at {
                out.push_str(&format!("Due: {}\n", when(due)));
            }
            out.push('\n');
            out.push_str(&quote(&message.body));
            out.push_str(&format!(
                "\n\nNext step: when done, return it with `handoffs return {short} --summary \"…\"` \
                 (MCP: return_work id={id}); add --blocked if you cannot finish.\n"
            ));
        }
        ("return", _) if message.work_id.is_none() => {
            // A fan-out's one combined return: its children are closed one by one.
            out.push_str(&format!(
                "{} from {}\n\n",
                message.title.as_deref().unwrap_or("Fan-out joined"),
                message.sender
            ));
            out.push_str(&quote(&message.body));
            out.push_str(
                "\n\nNext step: review the answers and close each child's work with \
                 `handoffs close ID accepted|revision|blocked` (MCP: close_work).\n",
            );
        }
        ("return", _) => {
            out.push_str(&format!(
                "{} from {}\n\n",
                message.title.as_deref().unwrap_or("Returned work"),
                message.sender
            ));
            out.push_str(&quote(&message.body));
            let work_id = message.work_id.as_deref().unwrap_or(id);
            let short_work = crate::text::short(work_id);
            out.push_str(&format!(
                "\n\nNext step: review it and close it with `handoffs close {short_work} accepted|revision|blocked` \
                 (MCP: close_work id={work_id}).\n"
            ));
        }
        _ => {
            out.push_str(&format!("Handoff from {}\n\n", message.sender));
            out.push_str(&quote(&message.body));
            out.push_str(&format!(
                "\n\nNext step: act on it; reply with `handoffs send {} {} -` (MCP: send_handoff).\n",
                message.recipient, message.sender
            ));
        }
    }
    out
}
