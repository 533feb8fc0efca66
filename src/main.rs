//! The `handoffs` binary: parse the command line, set up logging (stderr only), run the
//! command, and turn its outcome into one line on stderr and an exit code.

use clap::Parser;
use handoffs::front::cli::{self, Cli};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print to stdout and succeed; anything else is a usage error,
            // said in one line.
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            let rendered = e.render().to_string();
            // The first paragraph, folded into one line.
            let first: Vec<&str> = rendered
                .lines()
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            let first = first.join(" ");
            let first = first.strip_prefix("error: ").unwrap_or(&first);
            eprintln!("handoffs: {first}; see `handoffs --help`");
            return ExitCode::from(2);
        }
    };
    // HANDOFFS_LOG, else RUST_LOG, else warnings only; errors only for `sim`, whose engines'
    // warnings (a lease lost after a stall) are the simulated world's, told by its trace.
    let quiet = if matches!(cli.command, cli::Command::Sim { .. }) {
        "error"
    } else {
        "warn"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("HANDOFFS_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(quiet));
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    match cli.log_format {
        cli::LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        cli::LogFormat::Json => logs.json().with_current_span(true).init(),
    }
    match cli::run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            if !f.message.is_empty() || !matches!(f.code, 129 | 130 | 143) {
                eprintln!("handoffs: {}", f.message);
            }
            ExitCode::from(f.code)
        }
    }
}
