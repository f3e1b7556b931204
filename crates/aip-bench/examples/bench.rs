//! `aip bench` without the `aip` binary: the same arguments, table or `--json`.
//!
//! ```sh
//! cargo run --release -p aip-bench --example bench -- heartbeat --clients 10 --count 1000
//! ```

use clap::Parser;

/// Load a running AIP broker and measure it.
#[derive(Debug, Parser)]
#[command(name = "aip-bench")]
struct Cli {
    #[command(flatten)]
    bench: aip_bench::BenchArgs,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let json = cli.bench.options.json;
    match aip_bench::run(cli.bench).await {
        Ok(report) => {
            if json {
                if let Err(e) = report.print_json() {
                    eprintln!("error: {e}");
                    return std::process::ExitCode::from(3);
                }
            } else {
                report.print_table();
            }
            if report.failures == 0 && report.completed == report.expected {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(3)
        }
    }
}
